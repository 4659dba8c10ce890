"""torch.library and torch.compile over the op tree.

* Every ``hybridmeta::`` custom op passes ``torch.library.opcheck`` (schema and mutations,
  fake tensors, AOT dispatch with dynamic shapes) on the arguments its public function
  really passes it, recorded by a dispatch mode; a registered op that no public call
  reaches fails the suite.
* A decode step (conv update, SSM update, track save), a verify + commit and a prefill step
  (conv prefill, chunked scan, extend track save), each taking its metadata as an input,
  compile with ``fullgraph=True`` (no graph break can pass) under the ``eager``,
  ``aot_eager`` and ``inductor`` backends, for the reference and the Triton implementation
  (the interpreter on these CPU tensors), and give what eager gives.
* Recompiles stay bounded over batch sizes and plans (Dynamo's counters).

Shapes are tiny: every Triton launch here runs in the interpreter.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from hybridmeta import (
    ForwardMetadata,
    Mamba2Metadata,
    SpecCommitMetadata,
    plan_mixed_batch,
    prepare_commit,
    prepare_decode,
    prepare_target_verify,
)
from hybridmeta import kernels as K
from hybridmeta.kernels._dispatch import Impl, implementation, observed

# The op modules (``hybridmeta.kernels.linear`` is also the name of a function there).
linear_module = importlib.import_module("hybridmeta.kernels.linear")
ssm_module = importlib.import_module("hybridmeta.kernels.ssm_update")

H, P, N, G, KW = 2, 4, 8, 1, 4  # heads, head dim, state, groups, conv width
DIM = H * P + 2 * G * N  # conv channels
SLOTS = 64  # working slots below 32, track slots from 32
IMPLS: list[Impl] = ["reference", "triton"]
BACKENDS = ["eager", "aot_eager", "inductor"]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


# --------------------------------------------------------------------------- the steps


def decode_md(bs: int) -> Mamba2Metadata:
    """``bs`` decode rows (the last a pad row); the even live rows save into a track slot."""
    slots = torch.arange(bs, dtype=torch.int32)
    slots[-1] = -1
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32),
        mamba_cache_indices=slots,
        mamba_track_indices=torch.arange(bs, dtype=torch.int32) + 32,
        mamba_track_mask=(torch.arange(bs) % 2 == 0) & (slots >= 0),
        has_mamba_track_mask=True,
    )
    return prepare_decode(fwd)


def decode_inputs(bs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv_pool": _rand(1, SLOTS, DIM, KW - 1, gen=g),
        "ssm_pool": _rand(1, SLOTS, H, P, N, gen=g),
        "xbc": _rand(bs, DIM, gen=g),
        "w": _rand(DIM, KW, gen=g),
        "x": _rand(bs, H, P, gen=g),
        "dt": torch.rand(bs, H, generator=g),
        "A": -torch.rand(H, generator=g),
        "B": _rand(bs, G, N, gen=g),
        "C": _rand(bs, G, N, gen=g),
        "D": _rand(H, gen=g),
        "dt_bias": _rand(H, gen=g),
    }


def decode_step(md: Mamba2Metadata, t: dict[str, torch.Tensor], impl: Impl | None) -> Any:
    """One Mamba2 layer's decode (conv update, SSM update), then the forward's track save."""
    xbc = K.causal_conv1d_update_from_metadata(md, t["xbc"], t["conv_pool"][0], t["w"], impl=impl)
    y = K.ssm_state_update_from_metadata(
        md, t["ssm_pool"][0], t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"],
        dt_bias=t["dt_bias"], dt_softplus=True, impl=impl,
    )  # fmt: skip
    K.track_save_from_metadata(md, t["conv_pool"], t["ssm_pool"], impl=impl)
    return xbc, y


T_DRAFT = 3
TREE = [[-1, 0, 0], [-1, 0, 1], [-1, -1, 1], [-1, 0, 1], [-1, 0, 0]]


def verify_mds(bs: int) -> tuple[Mamba2Metadata, SpecCommitMetadata]:
    """A verify forward of ``bs`` rows (a tree, the last row a pad row) and its commit."""
    slots = torch.arange(bs, dtype=torch.int64)
    slots[-1] = -1
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(bs + 1) * T_DRAFT,
        mamba_cache_indices=slots,
        mamba_track_indices=torch.arange(bs) + 32,
        mamba_track_mask=(torch.arange(bs) % 2 == 1) & (slots >= 0),
        has_mamba_track_mask=True,
        is_target_verify=True,
        draft_token_num=T_DRAFT,
        retrieve_parent_token=torch.tensor([TREE[i % len(TREE)] for i in range(bs)]),
    )
    vmd = prepare_target_verify(fwd)
    cmd = prepare_commit(
        vmd,
        accepted_index=torch.arange(bs) % T_DRAFT - 1,  # -1: nothing accepted
        track_token=(torch.arange(bs) + 1) % T_DRAFT,
    )
    return vmd, cmd


def verify_inputs(bs: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv_pool": _rand(1, SLOTS, DIM, KW - 1, gen=g),
        "ssm_pool": _rand(1, SLOTS, H, P, N, gen=g),
        "inter_conv": torch.full((1, bs, T_DRAFT, DIM, KW - 1), float("nan")),
        "inter_ssm": torch.full((1, bs, T_DRAFT, H, P, N), float("nan")),
        "xbc": _rand(bs, T_DRAFT, DIM, gen=g),
        "w": _rand(DIM, KW, gen=g),
        "x": _rand(bs, T_DRAFT, H, P, gen=g),
        "dt": torch.rand(bs, T_DRAFT, H, generator=g),
        "A": -torch.rand(H, generator=g),
        "B": _rand(bs, T_DRAFT, G, N, gen=g),
        "C": _rand(bs, T_DRAFT, G, N, gen=g),
    }


def verify_commit_step(
    vmd: Mamba2Metadata, cmd: SpecCommitMetadata, t: dict[str, torch.Tensor], impl: Impl | None
) -> Any:
    """A verify of the draft (conv and SSM, the states of every draft token kept), then the
    commit of the verdict."""
    xbc = K.conv_verify_update_from_metadata(
        vmd, t["xbc"], t["conv_pool"][0], t["w"], inter=t["inter_conv"][0], impl=impl
    )
    y = K.ssm_verify_update_from_metadata(
        vmd, t["ssm_pool"][0], t["x"], t["dt"], t["A"], t["B"], t["C"], inter=t["inter_ssm"][0],
        impl=impl,
    )  # fmt: skip
    K.spec_commit_from_metadata(
        cmd, t["conv_pool"], t["ssm_pool"], t["inter_conv"], t["inter_ssm"], impl=impl
    )
    return xbc, y


#: Prefill plans of 2-4 rows, some resumed; the second differs from the first in every
#: planned size (tokens, rows, logical and physical chunks).
PLANS: list[tuple[list[int], list[int], list[int]]] = [
    ([5, 9], [0, 3], [2, 5]),
    ([4, 9, 7], [0, 2, 0], [1, 3, 9]),
    ([12, 6], [8, 0], [0, 4]),
    ([10, 13, 17], [3, 3, 5], [2, 5, 7]),
    ([19, 2, 11, 6], [0, 9, 0, 1], [3, 8, 1, 6]),
    ([6, 3], [0, 0], [4, 1]),
]
#: With tracking: mid-row boundaries of both kinds (1 on the chunk grid, 2 off it), every
#: output of the scan a different size (3 rows, 5 physical chunks).
TRACKED = ([19, 6, 11], [0, 5, 0], [1, 4, 2])


def prefill_md(plan: tuple[list[int], list[int], list[int]], track: bool = True) -> Mamba2Metadata:
    lens, prefix, slots = plan
    return plan_mixed_batch(
        extend_lens=lens,
        prefix_lens=prefix,
        slots=slots,
        num_decodes=0,
        chunk_size=8,
        conv_kernel=KW,
        track_interval=8,
        track_mask=[track] * len(lens),
        track_slots=[s + 32 for s in slots],
    )


def prefill_inputs(md: Mamba2Metadata, seed: int = 2) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    T = md.num_prefill_tokens
    return {
        "conv_state": _rand(SLOTS, DIM, KW - 1, gen=g),
        "ssm_state": _rand(SLOTS, H, P, N, gen=g),
        "xbc": _rand(T, DIM, gen=g),
        "w": _rand(DIM, KW, gen=g),
        "dt": torch.rand(T, H, generator=g),
        "params": K.SSMParams(A=-torch.rand(H, generator=g), D=_rand(H, gen=g), dt_bias=_rand(H, gen=g)),
    }


def prefill_step(md: Mamba2Metadata, t: dict[str, Any], impl: Impl | None) -> Any:
    """One Mamba2 layer's prefill: conv, chunked scan, the mid-row track boundaries."""
    conv = K.causal_conv1d_prefill(t["xbc"], t["w"], None, md=md, conv_state=t["conv_state"])
    x, B, C = K.split_xbc(conv.out, H, P, G, N)
    scan = K.ssd_chunked_scan(
        x, t["dt"], B, C, params=t["params"], md=md, ssm_state=t["ssm_state"], impl=impl
    )
    K.extend_track_save(
        md, xbc=t["xbc"], conv=conv, scan=scan, conv_state=t["conv_state"],
        ssm_state=t["ssm_state"],
    )  # fmt: skip
    return conv.out, scan.y, scan.final_states, scan.tracked_h, scan.recomputed


def _clone(t: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}


def _assert_same(got: Any, want: Any, backend: str) -> None:
    # Eager and aot_eager run the very ops eager runs; inductor may fuse and reassociate the
    # reference's fp32 arithmetic (a few ulps per op): the suite's fp32 tolerance.
    tol = {"rtol": 3e-4, "atol": 1e-3} if backend == "inductor" else {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(got, want, equal_nan=True, **tol)  # type: ignore[arg-type]


Case = Callable[[], tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]]


def _decode_case() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    return decode_step, (decode_md(4),), decode_inputs(4)


def _verify_case() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    return verify_commit_step, verify_mds(4), verify_inputs(4)


def _prefill_case() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    md = prefill_md(TRACKED)
    return prefill_step, (md,), prefill_inputs(md)


STEPS: dict[str, Case] = {"decode": _decode_case, "verify_commit": _verify_case,
                          "prefill": _prefill_case}  # fmt: skip


# Inductor's C++ code generation of the references' fused loops takes most of this file's
# time (about a minute a step on 2 loaded cores): those cases are also marked slow.
_COMBOS = [
    pytest.param(step, impl, backend, id=f"{step}-{impl}-{backend}",
                 marks=[pytest.mark.slow] if (impl, backend) == ("reference", "inductor") else [])
    for step in STEPS for impl in IMPLS for backend in BACKENDS
]  # fmt: skip


@pytest.mark.parametrize(("step", "impl", "backend"), _COMBOS)
def test_step_compiles_whole_and_equals_eager(step: str, impl: Impl, backend: str) -> None:
    fn, mds, t = STEPS[step]()
    want_t = _clone(t)
    want = fn(*mds, want_t, impl)
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    got = compiled(*mds, t, impl)
    _assert_same(got, want, backend)
    _assert_same(t, want_t, backend)  # the pools (and intermediate states) too
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_prefill_plan_exercises_every_track_kind() -> None:
    """The compiled prefill case saves boundaries of both kinds (a step with none would
    skip the extend track save's op)."""
    md = prefill_md(TRACKED)
    assert md.mixed is not None
    assert (md.mixed.track.num_h, md.mixed.track.num_recompute, md.num_prefills) == (1, 2, 3)
    assert md.mixed.chunks.phys_last_chunk.shape[0] == 5


@pytest.mark.parametrize("impl", IMPLS)
def test_implementation_block_is_the_default_inside_a_compiled_step(impl: Impl) -> None:
    """``impl=None``: the op calls take the enclosing ``implementation()`` block's choice,
    read at trace time and guarded (another block recompiles, never reuses the graph)."""
    ops: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Callable[..., Any]:
        ops.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)
    md = decode_md(4)
    other: Impl = "reference" if impl == "triton" else "triton"
    for choice in (impl, other, impl):
        t = decode_inputs(4)
        want_t = _clone(t)
        with implementation(choice):
            want = decode_step(md, want_t, None)
            got = compiled(md, t, None)
        _assert_same(got, want, "eager")
        _assert_same(t, want_t, "eager")
    assert len(ops) == 2  # one graph per implementation; the third call reuses the first
    launched = [any("hybridmeta" in o for o in graph) for graph in ops]
    assert launched == [impl == "triton", other == "triton"]


def _unique_graphs(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[int]:
    """Graphs compiled so far after each call of ``torch.compile(fn)`` (no fullgraph: a
    break would show as a second graph of one frame and in the break counter)."""
    compiled = torch.compile(fn, backend="eager")
    seen = []
    for args in calls:
        compiled(*args)
        seen.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    return seen


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_recompiles_once_for_every_batch_size(impl: Impl) -> None:
    """bs 2 compiles a static graph, bs 3 the dynamic one that serves every bs >= 2; bs 1
    (Dynamo specialises sizes 0 and 1) takes one more, and nothing compiles after that."""
    sizes = [2, 3, 5, 8, 13, 1, 21, 1, 6]
    seen = _unique_graphs(decode_step, [(decode_md(b), decode_inputs(b), impl) for b in sizes])
    assert seen == [1, 2, 2, 2, 2, 3, 3, 3, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_commit_recompiles_once_for_every_batch_size(impl: Impl) -> None:
    sizes = [2, 3, 5, 8, 1, 4]
    calls = [(*verify_mds(b), verify_inputs(b), impl) for b in sizes]
    assert _unique_graphs(verify_commit_step, calls) == [1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_recompiles_are_bounded_over_plans(impl: Impl) -> None:
    """Without mid-row boundaries (the extend save then does nothing): the first plan
    compiles a static graph, the second (every size differs) the dynamic one that every
    later plan reuses."""
    mds = [prefill_md(p, track=False) for p in PLANS]
    seen = _unique_graphs(prefill_step, [(md, prefill_inputs(md), impl) for md in mds])
    assert seen == [1, 2, 2, 2, 2, 2]


# --------------------------------------------------------------------------- the eager path


def test_eager_calls_launch_directly_and_observed_calls_go_through_the_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing observing: the public op calls its launcher itself (no dispatcher host
    time); under a dispatch mode (or tracing) the launch goes through the custom op."""
    direct: list[int] = []
    impl = ssm_module._ssm_state_update_impl

    def counted(*args: Any) -> None:
        direct.append(1)
        impl(*args)

    monkeypatch.setattr(ssm_module, "_ssm_state_update_impl", counted)
    t = decode_inputs(3)
    md = decode_md(3)

    def call() -> None:
        K.ssm_state_update_from_metadata(
            md, t["ssm_pool"][0], t["x"], t["dt"], t["A"], t["B"], t["C"], impl="triton"
        )

    call()
    assert direct == [1]
    assert not observed(t["x"])
    rec = _Recorder()
    with rec:
        call()
    assert direct == [1] and [name for name, _ in rec.calls] == ["hybridmeta::ssm_state_update"]


# --------------------------------------------------------------------------- opcheck


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every ``hybridmeta::`` op call with a copy of its arguments, then runs it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[str, tuple[tuple[Any, ...], dict[str, Any]]]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "hybridmeta":
            copied = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                              (args, kwargs))  # fmt: skip
            self.calls.append((func._schema.name, copied))
        return func(*args, **kwargs)


def _drive_every_op() -> list[tuple[str, tuple[tuple[Any, ...], dict[str, Any]]]]:
    """One call of every public op whose Triton implementation is a custom op (and the
    prefill ops, custom ops in both implementations), tiny CPU tensors."""
    g = torch.Generator().manual_seed(7)
    rec = _Recorder()
    with rec, implementation("triton"), pytest.MonkeyPatch.context() as mp:
        md = decode_md(4)
        decode_step(md, decode_inputs(4), None)
        K.ssm_state_update(  # destination slots: a variant of the op's arguments
            _rand(SLOTS, H, P, N, gen=g), _rand(2, H, P, gen=g), torch.rand(2, H, generator=g),
            -torch.rand(H, generator=g), _rand(2, G, N, gen=g), _rand(2, G, N, gen=g),
            state_indices=torch.tensor([3, -1]), dst_indices=torch.tensor([5, 6]),
            z=_rand(2, H, P, gen=g),
        )  # fmt: skip
        vmd, cmd = verify_mds(4)
        verify_commit_step(vmd, cmd, verify_inputs(4), None)
        x = _rand(3, 32, gen=g)
        K.add_rms_norm(x, _rand(3, 32, gen=g), _rand(32, gen=g), 1e-5)
        K.gated_rms_norm(x, _rand(3, 32, gen=g), _rand(32, gen=g), 16, 1e-5)
        K.relu_square(x)
        K.linear(x[:1], _rand(20, 32, gen=g), _rand(20, gen=g))  # one row: the GEMV
        mp.setattr(linear_module, "SKINNY_RULES",
                   (linear_module.SkinnyRule(linear_module.SkinnyConfig(16, 16)),))  # fmt: skip
        K.linear(x, _rand(20, 32, gen=g), None, input_activation="relu2")  # 3 rows: skinny
        k_cache, v_cache = _rand(5, 16, 2, 16, gen=g), _rand(5, 16, 2, 16, gen=g)
        slots, pos = torch.tensor([1, -1, 3]), torch.tensor([[4, 5], [0, 0], [9, 10]])
        K.kv_cache_write(_rand(3, 2, 2, 16, gen=g), _rand(3, 2, 2, 16, gen=g), k_cache, v_cache,
                         slots, pos)  # fmt: skip
        K.decode_attention(_rand(3, 2, 4, 16, gen=g), k_cache, v_cache, slots, pos, 0.25)
        pmd = prefill_md(TRACKED)
        for impl in IMPLS:
            prefill_step(pmd, prefill_inputs(pmd), impl)
        t = prefill_inputs(pmd)
        x, B, C = K.split_xbc(_rand(pmd.num_prefill_tokens, DIM, gen=g), H, P, G, N)
        K.ssd_chunked_scan(x, t["dt"], B, C, params=t["params"], md=pmd, ssm_state=t["ssm_state"],
                           return_chunk_states=True, impl="reference")  # fmt: skip
    return rec.calls


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    by_op: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
    for name, call in _drive_every_op():
        by_op.setdefault(name, []).append(call)
    return by_op


def _registered() -> list[str]:
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("hybridmeta::"))


def test_every_registered_op_is_exercised(
    recorded: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]],
) -> None:
    assert len(_registered()) >= 16
    assert sorted(recorded) == _registered()


@pytest.mark.parametrize("name", _registered())
def test_opcheck(
    name: str, recorded: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]
) -> None:
    namespace, op_name = name.split("::")
    op = getattr(getattr(torch.ops, namespace), op_name).default
    for args, kwargs in recorded.get(name, []):
        torch.library.opcheck(op, args, kwargs)


# --------------------------------------------------------------------------- cold start

_COLD = r"""
import torch
import hybridmeta.kernels as K
from hybridmeta.kernels import _errors
import tests.kernels.test_compile as tc

assert not _errors._RECORDS
for step in ("decode", "prefill"):
    fn, mds, t = tc.STEPS[step]()
    want_t = tc._clone(t)
    got = torch.compile(fn, backend="eager", fullgraph=True)(*mds, t, "triton")
    tc._assert_same(got, fn(*mds, want_t, "triton"), "eager")
    tc._assert_same(t, want_t, "eager")
    print(step, "compiled first, equal to eager")
# A fault inside a compiled region made cold reaches the device's one record.
torch._dynamo.reset()
_errors._RECORDS.clear()
fwd = tc.ForwardMetadata(
    query_start_loc=torch.arange(5, dtype=torch.int32),
    mamba_cache_indices=torch.tensor([0, 1000, 2, -1], dtype=torch.int32),
)
fault_md = tc.prepare_decode(fwd)
step = torch.compile(tc.decode_step, backend="eager", fullgraph=True)
step(tc.decode_md(4), tc.decode_inputs(4), "triton")
step(fault_md, tc.decode_inputs(4), "triton")
fault = K.check_errors("cpu")
assert len(_errors._RECORDS) == 1, _errors._RECORDS
assert fault is not None and fault.row == 1 and fault.value == 1000, fault
print("fault recorded:", fault.op, fault.field, fault.row, fault.value)
"""


def test_a_compiled_step_is_the_first_op_call_of_a_process() -> None:
    """The device's error record is made inside the compiled region when no op ran before
    (a fresh process: every other test here ran an op eagerly first)."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _COLD], cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decode compiled first, equal to eager" in done.stdout
    assert "prefill compiled first, equal to eager" in done.stdout
    assert "fault recorded: ssm_state_update" in done.stdout or "fault recorded: causal_conv1d_update" in done.stdout, done.stdout
