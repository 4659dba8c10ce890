"""Speculative-decoding kernel benchmark on one GPU at Nemotron-Nano-9B-v2 layer shapes.

Measures in one run: the device-to-device copy ceiling; the SSM verify update
(:func:`hybridmeta.kernels.ssm_verify_update`, a chain of ``T`` draft tokens per row) for
``T`` in 2, 4, 8, ``bs`` 1..256, fp32 and bf16 state; as baselines in the same run the
multi-token ``selective_state_update`` of FlashInfer 0.7.4 (CUDA), vLLM 0.33 (Triton,
accepted-token/varlen path) and sglang 0.5.23 (Triton), through the adapters of
``benchmarks/peers.py`` (optional: a missing peer is reported, not fatal); a launch-shape
sweep of the verify kernel; the conv verify update and the 27-layer commit.

Every time is a ``do_bench`` median with the L2 flushed before each repetition, of a CUDA
graph holding the call once per problem on rotating problems (enough that one replay
streams well past L2), divided by the number of calls: device time, no host launch cost.
Bytes moved per verify call: the working state read once, the ``T`` intermediate states
written, ``x``, ``z``, ``B``, ``C``, ``dt`` read and ``out`` written. Writes JSON and a PNG.

Run (GPU machine, with the peers bundle)::

    HYBRIDMETA_PEERS=<bundle> PYTHONPATH=src:. python3 benchmarks/bench_spec.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from hybridmeta.kernels import conv_verify_update, spec_commit, ssm_verify_update
from hybridmeta.kernels._config import SsmLaunchConfig
from hybridmeta.kernels.ssm_verify import launch_ssm_verify, ssm_verify_launch_config

H, P, N, G, CONV_DIM, K, LAYERS = 128, 80, 128, 8, 12288, 4, 27
T_LIST: tuple[int, ...] = (2, 4, 8)
BS_LIST: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PEERS: tuple[str, ...] = ("flashinfer", "vllm", "sglang")
ACT = torch.bfloat16
DEV = torch.device("cuda")
REP_MS = 30


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def med_us(fn: Callable[[], Any], rep: int = REP_MS) -> float:
    """Median time in microseconds, L2 flushed before every repetition (do_bench)."""
    if DEV.type != "cuda":  # --dry: one timed call, only to exercise the script
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench  # after hybridmeta chose interpreter or GPU

    return float(do_bench(fn, warmup=5, rep=rep, return_mode="median")) * 1000.0


def graph_us(calls: list[Callable[[], Any]]) -> float:
    """Per-call device time of ``calls`` captured in one CUDA graph (each on its own problem)."""
    if DEV.type != "cuda":
        return med_us(calls[0])
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    t = med_us(graph.replay) / len(calls)
    del graph
    return t


def copy_ceiling() -> dict[str, float]:
    n = 1 << 28 if DEV.type == "cuda" else 1 << 16  # 1 GiB of fp32 each way
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    t = med_us(lambda: dst.copy_(src), rep=100)
    return {"bytes": 2.0 * n * 4, "us": t, "tbps": 2.0 * n * 4 / t / 1e6}


class Verify:
    """One SSM verify problem: ``bs`` rows of a ``T``-token chain, slots scattered.

    State pool and intermediate buffer share one allocation (vLLM stores per-token states
    into slots of the pool it reads; every other implementation takes the same views).
    """

    def __init__(self, bs: int, T: int, state_dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        slots = bs + 1
        self.bs, self.T, self.state_dtype = bs, T, state_dtype
        pool = torch.empty(slots + bs * T, H, P, N, device=DEV, dtype=state_dtype)
        pool[:slots].normal_(generator=g)
        self.state = pool[:slots]
        self.inter = pool[slots:].view(bs, T, H, P, N)
        self.src = torch.randperm(slots, device=DEV, generator=g)[:bs].clone()
        self.x = torch.randn(bs, T, H, P, device=DEV, generator=g).to(ACT)
        self.z = torch.randn(bs, T, H, P, device=DEV, generator=g).to(ACT)
        # fp32 dt: FlashInfer would otherwise cast it to D's dtype on every call.
        self.dt = torch.randn(bs, T, H, device=DEV, generator=g) * 0.5
        self.B = torch.randn(bs, T, G, N, device=DEV, generator=g).to(ACT)
        self.C = torch.randn(bs, T, G, N, device=DEV, generator=g).to(ACT)
        self.A = -torch.rand(H, device=DEV, generator=g)
        self.D = torch.randn(H, device=DEV, generator=g)
        self.dt_bias = torch.randn(H, device=DEV, generator=g) * 0.5
        self.out = torch.empty_like(self.x)

    def nbytes(self) -> float:
        es = self.state.element_size()
        state = self.bs * (1 + self.T) * H * P * N * es  # read once + T intermediate writes
        acts = self.bs * self.T * (3 * H * P * 2 + 2 * G * N * 2 + H * 4)  # x, z, out; B, C; dt
        return float(state + acts)

    def ours(self) -> None:
        ssm_verify_update(
            self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src,
            inter=self.inter, D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=True,
            out=self.out,
        )  # fmt: skip

    def launcher(self, cfg: SsmLaunchConfig) -> Callable[[], None]:
        def run() -> None:
            launch_ssm_verify(
                self.state, self.x, self.dt, self.A, self.B, self.C, self.out, self.inter,
                self.src, D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=True,
                parent=None, num_draft=None, config=cfg,
            )  # fmt: skip

        return run

    def peer(self, fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            fn(
                self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src,
                intermediate_states=self.inter, D=self.D, z=self.z, dt_bias=self.dt_bias,
                dt_softplus=True, out=self.out,
            )  # fmt: skip

        return run


def rotating(nbytes: float, make: Callable[[int], Any]) -> list[Any]:
    """Enough independent problems that one graph replay streams well past the L2 cache."""
    n = max(1, min(16, math.ceil(256e6 / nbytes)))
    return [make(i) for i in range(n)]


def load_peers() -> tuple[ModuleType | None, dict[str, str]]:
    """``benchmarks/peers.py`` (the peers bundle adapters) or ``None``, and why each is missing."""
    try:
        peers = importlib.import_module("benchmarks.peers")
    except Exception as e:  # the peers are optional: report why they are missing
        return None, {name: f"benchmarks/peers.py not importable: {e!r}" for name in PEERS}
    why = {}
    for name in PEERS:
        reason = peers.why_unavailable(name)
        if reason is not None:
            why[name] = reason
    return peers, why


def agreement(peers: ModuleType, available: list[str]) -> list[dict[str, Any]]:
    """Relative error of each peer's outputs and intermediate states against ours (bs 4, T 4)."""
    rows: list[dict[str, Any]] = []
    for sd in (torch.float32, torch.bfloat16):
        prob = Verify(4, 4, sd, seed=7)
        prob.ours()
        out0, inter0 = prob.out.clone(), prob.inter.clone()
        for name in available:
            try:
                prob.out.fill_(float("nan"))
                prob.inter.fill_(float("nan"))
                prob.peer(peers.multi_token(name))()
                torch.cuda.synchronize()
                rel_o = float((prob.out.double() - out0.double()).abs().max() / out0.abs().max())
                rel_s = float(
                    (prob.inter.double() - inter0.double()).abs().max() / inter0.abs().max()
                )
                rows.append({"peer": name, "state_dtype": _name(sd), "out_rel": rel_o,
                             "inter_rel": rel_s})  # fmt: skip
            except Exception as e:
                rows.append({"peer": name, "state_dtype": _name(sd), "error": repr(e)[-1500:]})
            print("agreement", rows[-1], flush=True)
    return rows


def bench_verify(
    ceiling: float, peers: ModuleType | None, available: list[str]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sd in (torch.float32, torch.bfloat16):
        for T in T_LIST:
            for bs in BS_LIST:
                nbytes = Verify(1, T, sd).nbytes() * bs
                probs = rotating(nbytes, lambda i: Verify(bs, T, sd, seed=i))  # noqa: B023
                row: dict[str, Any] = {
                    "state_dtype": _name(sd),
                    "T": T,
                    "bs": bs,
                    "bs_x_T": bs * T,
                    "bytes": nbytes,
                    "calls_per_graph": len(probs),
                }
                t = graph_us([p.ours for p in probs])
                row |= {"ours_us": t, "ours_frac_copy": nbytes / t / 1e6 / ceiling}
                line = f"verify {_name(sd):8s} T={T} bs={bs:4d} ours {t:9.2f} us {row['ours_frac_copy']:.1%}"
                for name in available:
                    assert peers is not None
                    fn = peers.multi_token(name)
                    try:
                        tp = graph_us([p.peer(fn) for p in probs])
                        row |= {
                            f"{name}_us": tp,
                            f"{name}_frac_copy": nbytes / tp / 1e6 / ceiling,
                            f"{name}_over_ours": tp / t,
                        }
                        line += f" | {name} {tp:9.2f} us {tp / t:.2f}x"
                    except Exception as e:
                        row[f"{name}_error"] = repr(e)[-800:]
                        line += f" | {name} failed"
                rows.append(row)
                print(line, flush=True)
                del probs
            torch.cuda.empty_cache()
    return rows


def sweep_verify(ceiling: float) -> list[dict[str, Any]]:
    """Launch shapes of the verify kernel (block_p headdim rows x all of dstate, warps)."""
    res: list[dict[str, Any]] = []
    for sd in (torch.float32, torch.bfloat16):
        for T, bs in ((2, 128), (4, 64), (8, 32)):
            probs = rotating(Verify(1, T, sd).nbytes() * bs, lambda i: Verify(bs, T, sd, seed=i))  # noqa: B023
            for bp, nw in ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2), (32, 2), (8, 4)):
                cfg = SsmLaunchConfig(block_p=bp, num_warps=nw)
                t = graph_us([p.launcher(cfg) for p in probs])
                res.append({"state_dtype": _name(sd), "T": T, "bs": bs, "block_p": bp,
                            "num_warps": nw, "us": t,
                            "frac_copy": probs[0].nbytes() / t / 1e6 / ceiling})  # fmt: skip
            best = max((r for r in res if r["state_dtype"] == _name(sd) and r["T"] == T),
                       key=lambda r: r["frac_copy"])  # fmt: skip
            default = ssm_verify_launch_config(P, N)
            print(f"sweep {_name(sd)} T={T} bs={bs} best {best} (default block_p="
                  f"{default.block_p} warps={default.num_warps})", flush=True)  # fmt: skip
            del probs
    torch.cuda.empty_cache()
    return res


class ConvVerify:
    def __init__(self, bs: int, T: int, seed: int = 0) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        slots = bs + 1
        self.cs = torch.randn(slots, CONV_DIM, K - 1, device=DEV, generator=g).to(ACT)
        self.x = torch.randn(bs, T, CONV_DIM, device=DEV, generator=g).to(ACT)
        self.w = torch.randn(CONV_DIM, K, device=DEV, generator=g).to(ACT)
        self.b = torch.randn(CONV_DIM, device=DEV, generator=g).to(ACT)
        self.idx = torch.randperm(slots, device=DEV, generator=g)[:bs].clone()
        self.inter = torch.empty(bs, T, CONV_DIM, K - 1, device=DEV, dtype=ACT)
        self.out = torch.empty_like(self.x)
        self.nbytes = float(bs * (1 + T) * CONV_DIM * (K - 1) * 2 + 2 * bs * T * CONV_DIM * 2)

    def ours(self) -> None:
        conv_verify_update(
            self.x, self.cs, self.w, self.b, cache_indices=self.idx, inter=self.inter, out=self.out
        )


def bench_conv(ceiling: float) -> list[dict[str, Any]]:
    rows = []
    for T in (2, 4, 8):
        for bs in (16, 64, 256):
            probs = rotating(ConvVerify(1, T).nbytes * bs, lambda i: ConvVerify(bs, T, seed=i))  # noqa: B023
            t = graph_us([p.ours for p in probs])
            rows.append({"T": T, "bs": bs, "bytes": probs[0].nbytes, "ours_us": t,
                         "ours_frac_copy": probs[0].nbytes / t / 1e6 / ceiling})  # fmt: skip
            print("conv verify", rows[-1], flush=True)
            del probs
    return rows


#: (bs, tracked rows) of the commit's cases, T = 4.
COMMIT_CASES: tuple[tuple[int, int], ...] = ((16, 0), (16, 4), (64, 0))


class Commit:
    """One commit after a verify: 27 layers, fp32 SSM + bf16 conv, ``bs`` rows of a
    ``T``-token chain; the first ``tracked`` rows also copy their boundary token into a
    track slot."""

    def __init__(self, bs: int, tracked: int, T: int) -> None:
        slots = 2 * bs + 1
        self.bs, self.tracked, self.T = bs, tracked, T
        self.ssm = torch.empty(LAYERS, slots, H, P, N, device=DEV)
        self.conv = torch.empty(LAYERS, slots, CONV_DIM, K - 1, device=DEV, dtype=ACT)
        self.iss = torch.empty(LAYERS, bs, T, H, P, N, device=DEV)
        self.ic = torch.empty(LAYERS, bs, T, CONV_DIM, K - 1, device=DEV, dtype=ACT)
        perm = torch.randperm(slots, device=DEV)
        self.src, self.trk = perm[:bs].clone(), perm[bs : 2 * bs].clone()
        self.acc = torch.randint(0, T, (bs,), device=DEV)
        self.mask = torch.arange(bs, device=DEV) < tracked
        self.tok = torch.zeros(bs, dtype=torch.int64, device=DEV)
        per_row = LAYERS * (H * P * N * 4 + CONV_DIM * (K - 1) * 2)
        self.nbytes = float(2 * (bs + tracked) * per_row)

    def ours(self) -> None:
        spec_commit(
            self.conv, self.ssm, self.ic, self.iss, state_indices=self.src,
            accepted_index=self.acc, track_indices=self.trk, track_mask=self.mask,
            track_token=self.tok,
        )  # fmt: skip


def _commit_case(ceiling: float, bs: int, tracked: int, T: int) -> dict[str, Any]:
    c = Commit(bs, tracked, T)
    t = med_us(c.ours)
    return {"layers": LAYERS, "T": T, "bs": bs, "tracked": tracked, "bytes": c.nbytes,
            "ours_us": t, "ours_frac_copy": c.nbytes / t / 1e6 / ceiling}  # fmt: skip


def bench_commit(ceiling: float) -> list[dict[str, Any]]:
    """27 layers, fp32 SSM + bf16 conv, T = 4: every row commits; ``tracked`` rows also copy
    their boundary token into a track slot."""
    rows = []
    for bs, tracked in COMMIT_CASES:
        rows.append(_commit_case(ceiling, bs, tracked, 4))
        print("commit", rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    fig, axes = plt.subplots(2, len(T_LIST), figsize=(6 * len(T_LIST), 9), squeeze=False)
    labels = {"ours": "hybridmeta", "flashinfer": "FlashInfer 0.7.4", "vllm": "vLLM 0.33",
              "sglang": "sglang 0.5.23"}  # fmt: skip
    for i, dtype in enumerate(("float32", "bfloat16")):
        for j, T in enumerate(T_LIST):
            ax = axes[i][j]
            rows = [r for r in result["verify"] if r["state_dtype"] == dtype and r["T"] == T]
            bs = [r["bs"] for r in rows]
            for key, style in (("ours", "o-"), ("flashinfer", "s--"), ("vllm", "x--"),
                               ("sglang", "^--")):  # fmt: skip
                ys = [100 * r.get(f"{key}_frac_copy", float("nan")) for r in rows]
                if any(not math.isnan(y) for y in ys):
                    ax.plot(bs, ys, style, label=labels[key])
            ax.axhline(85, color="k", ls=":", lw=1, label="85% target (bs x T >= 256)")
            ax.axvline(256 / T, color="grey", ls=":", lw=1)
            ax.set(xscale="log", ylim=(0, 100), xlabel="batch size",
                   ylabel="% of D2D copy bandwidth",
                   title=f"SSM verify, T={T}, {dtype} state")  # fmt: skip
            ax.legend(fontsize=8)
    fig.suptitle(
        f"Nemotron-Nano-9B-v2 layer (H 128, P 80, N 128, G 8), {result['device']}, copy "
        f"ceiling {result['copy_ceiling']['tbps']:.2f} TB/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _make_dry() -> None:
    global H, P, N, G, CONV_DIM, LAYERS, T_LIST, BS_LIST, DEV
    H, P, N, G, CONV_DIM, LAYERS = 2, 4, 8, 1, 16, 2
    T_LIST, BS_LIST = (2,), (1, 3)
    DEV = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    ap.add_argument("--tag", default="h200", help="file name tag")
    ap.add_argument("--no-peers", action="store_true", help="skip the peers")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-shape sweep")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU interpreter")
    args = ap.parse_args()
    if args.dry:
        _make_dry()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"nheads": H, "headdim": P, "dstate": N, "ngroups": G, "conv_dim": CONV_DIM,
                   "k": K, "layers": LAYERS, "activations": "bfloat16 (dt, A, D, dt_bias fp32)"},
        "method": "triton.testing.do_bench median, L2 flushed before each repetition, of a CUDA "
        "graph of one call per rotating problem, divided by the calls; bytes = state read "
        "once + T intermediate states written + x, z, B, C, dt read + out written",
    }  # fmt: skip
    path = out / f"spec_{args.tag}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    peers, why = (None, dict.fromkeys(PEERS, "--no-peers")) if args.no_peers else load_peers()
    available = [p for p in PEERS if p not in why]
    build: concurrent.futures.Future[list[str]] | None = None
    if peers is not None and "flashinfer" in available:
        # T 4 ships prebuilt in the bundle; 2 and 8 JIT-build (~16 s) while ours runs.
        build = concurrent.futures.ThreadPoolExecutor(1).submit(
            peers.prebuild_flashinfer, (torch.float32, torch.bfloat16), (2, 8), dim=P, dstate=N
        )
    result["peers"] = {"available": available, "missing": why}
    if peers is not None:
        result["peers"]["versions"] = {k: v.get("version") for k, v in peers.versions().items()}
    result["copy_ceiling"] = copy_ceiling()
    ceiling = result["copy_ceiling"]["tbps"]
    print(f"copy ceiling {ceiling:.3f} TB/s; peers {available}, missing {why}", flush=True)
    if not args.no_sweep:
        result["sweep"] = sweep_verify(ceiling)
        save()
    if build is not None:
        try:
            result["peers"]["flashinfer_build"] = build.result(timeout=240)
        except Exception as e:  # report and go on without FlashInfer
            result["peers"]["flashinfer_build_error"] = repr(e)[-2000:]
            available.remove("flashinfer")
    if peers is not None and available:
        result["agreement"] = agreement(peers, available)
    result["verify"] = bench_verify(ceiling, peers, available)
    save()
    result["conv_verify"] = bench_conv(ceiling)
    result["commit"] = bench_commit(ceiling)
    save()
    try:
        plot(result, out / f"spec_{args.tag}.png")
    except Exception as e:  # a missing matplotlib must not lose the numbers
        print(f"plot failed: {e!r}")
    print(f"wrote {path}", flush=True)
    if build is not None and not build.done():
        os._exit(0)  # do not wait for an unfinished nvcc build at exit


if __name__ == "__main__":
    main()
