"""Registers a thread of the SSM update, SSM verify and conv update kernels, from ptxas, without a GPU.

Compiles the kernels for ``sm_90a`` (the H200) with the installed Triton and its bundled
ptxas, at Nemotron-Nano-9B-v2 layer shapes with the launch options of
:func:`hybridmeta.kernels._config.ssm_launch_config` (bf16: two warps, fp32: one), and prints
the registers, stack and local memory (spills) of each (Triton's ptxas, read back from the
cubin with the bundled ``cuobjdump``), and its SASS instructions split at its call targets
(the entry and each outlined callee) with the memory instructions by opcode. Resident
programs per SM follow from the registers (65,536 a SM, allocated per warp in units of
256). ``docs/perf_notes.md`` ("Round 3, third
GPU session") used it to rule the register count out as the cause of the slot checks' cost
in the bf16 tiles; use the Triton version of the GPU image (3.6.0 there) for the figures to
carry over. ``--src`` compiles another tree's kernels (a ``git archive``
of a commit), ``--maxnreg`` caps ptxas as ``SsmLaunchConfig.max_regs`` does.

Run (any machine, no GPU needed)::

    PYTHONPATH=src:. python3 benchmarks/ptxas_regs.py --out "$OUT" [--src TREE/src] [--sass DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

H, P, N, G = 128, 80, 128, 8
#: (kernel, state dtype, rows a program): the launches of the benchmarks' SSM sections.
CASES: tuple[tuple[str, str, int], ...] = (
    ("tile", "bf16", 1),
    ("tile", "bf16", 16),
    ("tile", "bf16", 32),
    ("tile", "fp32", 1),
    ("walk", "fp32", 1),
    ("verify", "bf16", 1),
    ("verify", "fp32", 1),
    # the conv update, bf16 state: rows 1 = the [slots, conv_dim, k-1] pool, rows 4 = the
    # conv_dim-contiguous [slots, k-1, conv_dim] one (conv_launch_config)
    ("conv", "bf16", 1),
    ("conv", "bf16", 4),
)
CONV_DIM, CONV_K = 12288, 4
_NOSPEC = {"bs", "pad_id", "n_slots", "rows_per_prog", "T", "stride_par_b"}
_ABSENT = {"dst_ptr", "track_idx_ptr", "track_mask_ptr", "parent_ptr", "ndraft_ptr"}


def _ints() -> dict[str, int]:
    return dict(
        headdim=P, dstate=N, heads_per_group=H // G, stride_s_slot=H * P * N, stride_s_h=P * N,
        stride_s_p=N, stride_s_n=1, stride_x_b=H * P, stride_x_h=P, stride_x_p=1,
        stride_dt_b=H, stride_dt_h=1, stride_B_b=G * N, stride_B_g=N, stride_B_n=1,
        stride_C_b=G * N, stride_C_g=N, stride_C_n=1, stride_z_b=H * P, stride_z_h=P,
        stride_z_p=1, stride_o_b=H * P, stride_o_h=P, stride_o_p=1, bs=256, pad_id=-1,
        n_slots=1000, rows_per_prog=4, T=4, stride_par_b=4, stride_par_t=1,
        stride_x_t=H * P, stride_dt_t=H, stride_B_t=G * N, stride_C_t=G * N, stride_z_t=H * P,
        stride_o_t=H * P, stride_i_b=4 * H * P * N, stride_i_t=H * P * N,
    )  # fmt: skip


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", re.M)
_CALL = re.compile(r"CALL\.REL(?:\.NOINC)?\s+(0x[0-9a-f]+)")
_MEMORY = ("LDG", "STG", "LDS", "STS", "LDL", "STL", "ATOM", "ATOMG", "RED", "LD", "ST")


def sass_profile(sass: str) -> list[dict[str, Any]]:
    """The kernel's SASS split at its call targets (the entry, then each outlined
    ``noinline`` callee: the row body of a multi-row tile): per part, its first address,
    its instruction count and its memory instructions by opcode (``LDG.E.128``: 16-byte
    global loads)."""
    ins = [(int(a, 16), op, rest) for a, op, rest in _INSTR.findall(sass)]
    starts = sorted({0, *(int(t, 16) for _, op, rest in ins if op.startswith("CALL")
                          for t in _CALL.findall(op + rest))})  # fmt: skip
    parts: list[dict[str, Any]] = []
    for i, lo in enumerate(starts):
        hi = starts[i + 1] if i + 1 < len(starts) else 1 << 62
        body = [op for a, op, _ in ins if lo <= a < hi]
        memory = Counter(op for op in body if op.split(".")[0] in _MEMORY)
        parts.append({"start": hex(lo), "instructions": len(body), "memory": dict(memory)})
    return parts


def compile_case(
    kernel: str, dtype: str, rows: int, maxnreg: int | None, sass_dir: Path | None = None
) -> dict[str, Any]:
    """ptxas's figures for one kernel variant (the module must be importable); with
    ``sass_dir``, its SASS (``cuobjdump -sass``) is written there too."""
    import torch

    import hybridmeta.kernels.ssm_update as su
    import hybridmeta.kernels.ssm_verify as sv
    from hybridmeta.kernels._config import ssm_launch_config

    ints_const = _ints()

    ptrs = {
        "state_ptr": f"*{dtype}", "x_ptr": "*bf16", "dt_ptr": "*fp32", "dt_bias_ptr": "*fp32",
        "A_ptr": "*fp32", "B_ptr": "*bf16", "C_ptr": "*bf16", "D_ptr": "*fp32",
        "z_ptr": "*bf16", "out_ptr": "*bf16", "src_ptr": "*i64", "err_ptr": "*i64",
        "inter_ptr": f"*{dtype}",
    }  # fmt: skip
    if kernel == "conv":
        return _compile_conv(rows, maxnreg, sass_dir)
    # The tile and warps the tree's own launch configuration picks at these shapes.
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = (
        sv.ssm_verify_launch_config(P, N) if kernel == "verify"
        else ssm_launch_config(torch_dtype, P, N)
    )  # fmt: skip
    flags = dict(DT_SOFTPLUS=True, HAS_DT_BIAS=True, HAS_D=True, HAS_Z=True, BLOCK_N=N)
    opts: dict[str, Any] = {"num_warps": cfg.num_warps}
    if kernel == "tile":
        fn = su._ssm_update_tile_kernel
        cx = dict(flags, HAS_DST=False, HAS_TRACK=False, BLOCK_P=cfg.block_p, ROWS=rows,
                  LATE_POISON=getattr(cfg, "late_poison", False))  # fmt: skip
    elif kernel == "walk":
        fn = su._ssm_update_kernel
        cx = dict(flags, HAS_DST=False, HAS_TRACK=False, BLOCK_P=cfg.block_p,
                  ROW_BLOCK=cfg.row_block, N_PTILES=-(-P // cfg.block_p))  # fmt: skip
        opts = {"num_warps": cfg.num_warps, "num_stages": 1}
    else:
        fn = sv._ssm_verify_kernel
        cx = dict(flags, HAS_PARENT=False, HAS_NDRAFT=False, BLOCK_P=cfg.block_p)
    # A tree that makes the pad id and pool size constexprs compiles with the values here.
    cx.update(pad_id=ints_const["pad_id"], n_slots=ints_const["n_slots"])
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    sig, consts, attrs = _signature(fn, ptrs, _ints(), cx)
    return _inspect(kernel, dtype, rows, maxnreg, sass_dir, fn, sig, consts, attrs, opts)


def _signature(
    fn: Any, ptrs: dict[str, str], ints: dict[str, int], cx: dict[str, Any]
) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], list[list[Any]]]]:
    """The signature, constants and attributes Triton would specialise ``fn`` to for these
    argument values (16-byte aligned pointers, absent optional pointers, ints equal to 1
    folded, multiples of 16 marked)."""
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr or name in _ABSENT:
            sig[name] = "constexpr"
            consts[(i,)] = cx[name] if p.is_constexpr else None
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("dt_min", "dt_max"):
            sig[name] = "fp32"
        elif name not in _NOSPEC and ints[name] == 1:  # Triton specialises 1 away
            sig[name] = "constexpr"
            consts[(i,)] = 1
        else:
            sig[name] = "i32"
            if name not in _NOSPEC and ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _inspect(
    kernel: str,
    dtype: str,
    rows: int,
    maxnreg: int | None,
    sass_dir: Path | None,
    fn: Any,
    sig: dict[str, str],
    consts: dict[tuple[int, ...], Any],
    attrs: dict[tuple[int, ...], list[list[Any]]],
    opts: dict[str, Any],
) -> dict[str, Any]:
    """Compile one signature for sm_90a and read ptxas's figures and the SASS back."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn, sig, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    # The cubin Triton's own ptxas made; its resource usage from the bundled cuobjdump.
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        run = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        )
        dis = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True)
    if run.returncode != 0 or dis.returncode != 0:
        raise RuntimeError(
            f"cuobjdump failed on {kernel} {dtype} rows {rows}: {run.stderr}{dis.stderr}"
        )
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{kernel}_{dtype}_rows{rows}.sass").write_text(dis.stdout)
    # One "Function" line per function (the kernel and its outlined callees): the largest.
    used = [int(m) for m in re.findall(r"REG:(\d+)", run.stdout)]
    local = [int(m) for m in re.findall(r"LOCAL:(\d+)", run.stdout)]
    stack = [int(m) for m in re.findall(r"STACK:(\d+)", run.stdout)]
    if not used:
        raise RuntimeError(f"no register count in cuobjdump's output: {run.stdout}")
    warps = int(opts["num_warps"])
    regs = max(used)
    per_warp = -(-regs * 32 // 256) * 256
    return {
        "kernel": kernel, "state_dtype": dtype, "rows": rows, "maxnreg": maxnreg,
        "num_warps": warps, "registers": regs, "local_bytes": max(local, default=0),
        "stack_bytes": max(stack, default=0),
        "programs_per_sm": min(65536 // per_warp // warps, 32),
        "sass": sass_profile(dis.stdout),
    }  # fmt: skip


def _compile_conv(rows: int, maxnreg: int | None, sass_dir: Path | None) -> dict[str, Any]:
    """The conv update at the benchmark's shapes (bf16 state, x, weights and bias; width 4,
    SiLU), with the tree's ``conv_launch_config``: ``rows`` 4 is the conv_dim-contiguous
    pool, 1 the ``[slots, conv_dim, k-1]`` one."""
    import hybridmeta.kernels.conv_update as cu
    from hybridmeta.kernels._config import conv_launch_config

    inner = rows > 1
    cfg = conv_launch_config(CONV_DIM, channels_contiguous=inner)
    if cfg.rows != rows:
        raise RuntimeError(f"conv_launch_config gives {cfg.rows} rows a program, not {rows}")
    fn = cu._conv_update_kernel
    ptrs = {"x_ptr": "*bf16", "conv_state_ptr": "*bf16", "weight_ptr": "*bf16",
            "bias_ptr": "*bf16", "out_ptr": "*bf16", "slot_ptr": "*i64", "err_ptr": "*i64"}  # fmt: skip
    w = CONV_K - 1
    ints = dict(
        bs=256, pad_id=-1, n_slots=1000, dim=CONV_DIM, stride_x_b=CONV_DIM, stride_x_c=1,
        stride_cs_slot=w * CONV_DIM, stride_cs_c=1 if inner else w,
        stride_cs_w=CONV_DIM if inner else 1, stride_w_c=CONV_K, stride_w_k=1,
        stride_o_b=CONV_DIM, stride_o_c=1,
    )  # fmt: skip
    cx = dict(WIDTH=CONV_K, HAS_BIAS=True, SILU=True, ROWS=cfg.rows, BLOCK_C=cfg.block_c,
              BLOCK_K=CONV_K)  # fmt: skip
    opts: dict[str, Any] = {"num_warps": cfg.num_warps}
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    sig, consts, attrs = _signature(fn, ptrs, ints, cx)
    return _inspect("conv", "bf16", rows, maxnreg, sass_dir, fn, sig, consts, attrs, opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    ap.add_argument("--src", type=Path, help="another tree's src/ to compile (default: this one)")
    ap.add_argument("--maxnreg", type=int, help="ptxas register cap")
    ap.add_argument("--tag", default="sm90a", help="file name tag")
    ap.add_argument("--sass", type=Path, help="also write each case's SASS into this folder")
    ap.add_argument(
        "--cases", help="comma-separated kernel:dtype:rows (e.g. tile:bf16:1), default: all"
    )
    args = ap.parse_args()
    # Compile, never interpret: set before hybridmeta chooses for a machine without CUDA.
    os.environ["TRITON_INTERPRET"] = "0"
    if args.src is not None:
        sys.path.insert(0, str(args.src.resolve()))
    import triton

    import hybridmeta

    cases = CASES
    if args.cases:
        wanted = {tuple(c.split(":")) for c in args.cases.split(",")}
        cases = tuple(c for c in CASES if (c[0], c[1], str(c[2])) in wanted)
        if not cases:
            ap.error(f"--cases: none of {sorted(wanted)} is a case of {CASES}")
    rows = [compile_case(k, d, r, args.maxnreg, args.sass) for k, d, r in cases]
    for r in rows:
        parts = ", ".join(str(p["instructions"]) for p in r["sass"])
        print(
            f"{r['kernel']:6} {r['state_dtype']} rows {r['rows']:2}: {r['registers']} registers, "
            f"local memory {r['local_bytes']} B, stack {r['stack_bytes']} B, "
            f"{r['programs_per_sm']} programs an SM; SASS instructions (entry, callees) {parts}"
        )
    result = {
        "target": "cuda sm_90a (ptxas bundled with Triton)",
        "triton": triton.__version__,
        "hybridmeta_from": str(Path(hybridmeta.__file__).parent),
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shapes": {"nheads": H, "headdim": P, "dstate": N, "ngroups": G},
        "cases": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ptxas_regs_{args.tag}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
