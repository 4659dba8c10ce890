"""The capture/replay runner: buckets, padding, same results as eager, no device sync."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from hybridmeta.core import TOKENS
from hybridmeta.debug import debug_mode, is_debug
from hybridmeta.graphs import (
    EmulatedGraphBackend,
    GraphCaptureError,
    GraphRunner,
    InputSpec,
    StaticBuffers,
)
from hybridmeta.model import ForwardMetadata, Mamba2Metadata
from tests.graphs.toy import ToyMamba

H, D = 2, 4
MAX_BS = 5
SLOTS = 12


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _setup(device: torch.device) -> tuple[ToyMamba, GraphRunner]:
    model = ToyMamba(SLOTS, H, D, gen=torch.Generator().manual_seed(0), device=device)
    buffers = StaticBuffers(max_bs=MAX_BS, num_slots=SLOTS, device=device, inputs=model.input_specs)
    # The default backend: real CUDA graphs on a CUDA device, the emulation on the CPU.
    runner = GraphRunner(model.step, buffers, buckets=(1, 2, 4, MAX_BS))
    runner.capture()
    return model, runner


def _fwd(
    device: torch.device, slots: list[int], track: list[int], mask: list[bool]
) -> ForwardMetadata:
    return ForwardMetadata(
        query_start_loc=torch.arange(len(slots) + 1, device=device),
        mamba_cache_indices=torch.tensor(slots, device=device),
        mamba_track_indices=torch.tensor(track, device=device),
        mamba_track_mask=torch.tensor(mask, device=device),
        has_mamba_track_mask=any(mask),
    )


_STEPS = [
    ([3], [8], [True]),
    ([0, 5, 2], [9, -1, 10], [True, False, True]),
    ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [False, True, False, True, False]),
    ([7, 11], [-1, 1], [False, True]),
]


def test_replay_matches_eager_reference_across_buckets(device: torch.device) -> None:
    model, runner = _setup(device)
    gen = torch.Generator().manual_seed(1)
    for slots, track, mask in _STEPS:
        inputs = model.random_inputs(gen, len(slots))
        before = model.state[:SLOTS].cpu()
        pool, y_ref = model.oracle(before, inputs, slots, track, mask)
        out = runner.run(_fwd(device, slots, track, mask), {"x": inputs["x"].to(device)})
        assert out["y"].shape == (len(slots), H)
        # y sums D = 4 products per head; the batched step and the row-at-a-time oracle may
        # order the sum differently: <= 3 * 2**-24 * sum|terms| ~ 1e-6 here, inside 1e-5
        torch.testing.assert_close(out["y"].cpu(), y_ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.state[:SLOTS].cpu(), pool)


def test_bucket_selection_pads_to_the_smallest_captured_bucket() -> None:
    _, runner = _setup(torch.device("cpu"))
    assert [runner.bucket_for(bs) for bs in range(1, MAX_BS + 1)] == [1, 2, 4, 4, 5]
    assert runner.captured


def test_run_before_capture_is_refused() -> None:
    buffers = StaticBuffers(max_bs=2, num_slots=4, device="cpu")
    runner = GraphRunner(lambda md, ins: {}, buffers)
    assert not runner.captured
    with pytest.raises(RuntimeError, match="capture"):
        runner.run(_fwd(torch.device("cpu"), [1], [-1], [False]))


def test_run_refuses_bs_past_max_bs() -> None:
    _, runner = _setup(torch.device("cpu"))
    with pytest.raises(ValueError, match="max_bs"):
        runner.run(_fwd(torch.device("cpu"), list(range(MAX_BS + 1)), [-1] * 6, [False] * 6))


@pytest.mark.parametrize("buckets", [(), (0, 2), (1, 2)])
def test_buckets_must_end_at_max_bs(buckets: tuple[int, ...]) -> None:
    buffers = StaticBuffers(max_bs=3, num_slots=4, device="cpu")
    with pytest.raises(ValueError, match="buckets"):
        GraphRunner(lambda md, ins: {}, buffers, buckets=buckets)


def test_backend_device_must_match_buffers() -> None:
    buffers = StaticBuffers(max_bs=3, num_slots=4, device="cpu")
    with pytest.raises(ValueError, match="device"):
        GraphRunner(lambda md, ins: {}, buffers, backend=EmulatedGraphBackend("meta"))


def test_outputs_must_be_per_row() -> None:
    buffers = StaticBuffers(max_bs=3, num_slots=4, device="cpu")

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"bad": torch.zeros(7)}

    with pytest.raises(ValueError, match="output 'bad'"):
        GraphRunner(step, buffers).capture()


def test_a_step_that_syncs_cannot_be_captured() -> None:
    buffers = StaticBuffers(max_bs=2, num_slots=4, device="cpu")

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n = int((md.mamba_cache_indices >= 0).sum())  # a host decision from device data
        return {"y": md.mamba_cache_indices[:n].float()}

    with pytest.raises(GraphCaptureError, match="sync"):
        GraphRunner(step, buffers).capture()


@pytest.mark.gpu
def test_run_path_does_not_sync_the_device() -> None:
    device = torch.device("cuda")
    model, runner = _setup(device)
    gen = torch.Generator().manual_seed(2)
    steps = [
        (_fwd(device, s, t, m), {"x": torch.randn(len(s), H, D, generator=gen).to(device)})
        for s, t, m in _STEPS
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fwd, inputs in steps:
            runner.run(fwd, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(model.state).all()


def test_target_verify_runner_slices_per_token_outputs() -> None:
    draft = 3
    buffers = StaticBuffers(
        max_bs=4,
        num_slots=8,
        device="cpu",
        max_draft=draft,
        static={"is_target_verify": True},
        inputs={"h": InputSpec((2,), torch.float32, rows=TOKENS)},
    )

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Per token: h + the token's row slot; per row: the row's slot.
        slots = md.mamba_cache_indices.repeat_interleave(md.draft_token_num)
        return {"tok": ins["h"] + slots[:, None], "row": md.mamba_cache_indices * 10}

    runner = GraphRunner(step, buffers, buckets=(2, 4), draft_buckets=(draft,))
    runner.capture()
    fwd = ForwardMetadata(
        query_start_loc=torch.tensor([0, 3]),
        mamba_cache_indices=torch.tensor([5]),
        is_target_verify=True,
        draft_token_num=draft,
    )
    out = runner.run(fwd, {"h": torch.ones(3, 2)})
    assert out["tok"].tolist() == [[6.0, 6.0]] * 3
    assert out["row"].tolist() == [50]


def test_capture_in_debug_mode_turns_syncing_step_checks_off() -> None:
    # Debug checks read device values; inside a capture they would sync, so capture runs
    # with debug mode off, while refresh still runs its own checks in debug mode.
    seen: list[bool] = []

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append(is_debug())
        return {"y": md.mamba_cache_indices + 1}

    runner = GraphRunner(step, StaticBuffers(max_bs=2, num_slots=4, device="cpu"))
    with debug_mode():
        runner.capture()
        assert seen and not any(seen)
        with pytest.raises(ValueError, match="rows 0 and 1 hold the same slot 1"):
            runner.run(_fwd_unchecked([1, 1]))
        assert runner.run(_fwd_unchecked([3]))["y"].tolist() == [4]


def _fwd_unchecked(slots: list[int]) -> ForwardMetadata:
    with debug_mode(False):  # build a bad step without the core's own debug checks
        return ForwardMetadata(
            query_start_loc=torch.arange(len(slots) + 1),
            mamba_cache_indices=torch.tensor(slots),
        )


# ------------------------------------------------------- the stale tail, every public path


def _zero(name: str, t: torch.Tensor) -> None:
    t.zero_()


def _state_and_buffers(model: ToyMamba, runner: GraphRunner) -> dict[str, torch.Tensor]:
    snap = runner.buffers.snapshot()
    snap["<pool>"] = model.state.clone()
    return snap


def _assert_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    for key, t in before.items():
        assert torch.equal(after[key].view(torch.uint8), t.view(torch.uint8)), key


def test_replaying_a_bucket_other_than_the_refreshed_one_is_refused() -> None:
    # Issue 21: refresh(fwd, 2) then graph(4).replay() replayed the bucket-4 graph over rows
    # 2-3 still holding the previous step's slots and inputs (two requests advanced by a
    # stale token).
    cpu = torch.device("cpu")
    model, runner = _setup(cpu)
    gen = torch.Generator().manual_seed(3)
    four = model.random_inputs(gen, 4)
    runner.run(_fwd(cpu, [1, 2, 3, 4], [-1] * 4, [False] * 4), four)  # rows 2-3: slots 3, 4
    two = model.random_inputs(gen, 2)
    fwd = _fwd(cpu, [7, 8], [-1, -1], [False, False])
    runner.buffers.refresh(fwd, 2, two)
    assert runner.buffers.refreshed_bucket == (2, 1)
    before = _state_and_buffers(model, runner)
    with pytest.raises(
        RuntimeError,
        match=r"GraphRunner\.graph\(4, 1\)\.replay: the static buffers hold bucket \(2, 1\), not "
        r"\(4, 1\): this graph would read rows that no refresh for it wrote",
    ):
        runner.graph(4).replay()
    _assert_same(before, _state_and_buffers(model, runner))
    # The refreshed bucket's graph replays the step; so does bucket 4 once refreshed for it.
    pool, y_ref = model.oracle(model.state[:SLOTS].clone(), two, [7, 8], [-1, -1], [False] * 2)
    graph = runner.graph(2)
    graph.replay()
    torch.testing.assert_close(graph.outputs["y"], y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.state[:SLOTS], pool)
    runner.buffers.refresh(fwd, 4, two)
    pool, _ = model.oracle(model.state[:SLOTS].clone(), two, [7, 8], [-1, -1], [False] * 2)
    runner.graph(4).replay()
    assert torch.equal(model.state[:SLOTS], pool)  # rows 2-3 are pad rows now: slots 3, 4 kept


def test_a_graph_handle_refuses_after_its_rows_were_overwritten_or_recaptured() -> None:
    cpu = torch.device("cpu")
    model, runner = _setup(cpu)
    x = model.random_inputs(torch.Generator().manual_seed(4), 2)
    runner.buffers.refresh(_fwd(cpu, [1, 2], [-1, -1], [False, False]), 2, x)
    graph = runner.graph(2)
    runner.buffers.poison_(1, _zero)  # row 1 of bucket 2 overwritten
    with pytest.raises(RuntimeError, match=r"the static buffers hold no complete bucket"):
        graph.replay()
    runner.buffers.refresh(_fwd(cpu, [1, 2], [-1, -1], [False, False]), 2, x)
    runner.buffers.poison_(2, _zero)  # past the bucket: it stays whole
    graph.replay()
    runner.capture()
    runner.buffers.refresh(_fwd(cpu, [1, 2], [-1, -1], [False, False]), 2, x)
    with pytest.raises(RuntimeError, match=r"this graph belongs to an earlier capture\(\)"):
        graph.replay()
    runner.graph(2).replay()


def test_a_runner_whose_capture_failed_refuses_to_run_before_writing() -> None:
    # Issue 21: after a capture that failed part way, run() refreshed the buffers and then
    # raised a bare KeyError((1, 1)).
    cpu = torch.device("cpu")
    model = ToyMamba(SLOTS, H, D, gen=torch.Generator().manual_seed(5), device=cpu)
    fail = {"bucket": 1}

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if md.num_decodes == fail["bucket"]:
            raise RuntimeError("out of workspace")
        return model.step(md, ins)

    buffers = StaticBuffers(max_bs=MAX_BS, num_slots=SLOTS, device=cpu, inputs=model.input_specs)
    runner = GraphRunner(step, buffers, buckets=(1, 2, 4, MAX_BS))
    with pytest.raises(RuntimeError, match="out of workspace"):
        runner.capture()
    captured = [runner.captured]
    fwd = _fwd(cpu, [3, 1], [-1, -1], [False, False])
    x = model.random_inputs(torch.Generator().manual_seed(6), 2)

    def junk(name: str, t: torch.Tensor) -> None:
        t.fill_(True if t.dtype == torch.bool else 5)

    buffers.poison_(0, junk)
    before = _state_and_buffers(model, runner)
    refusal = (
        r"the last capture\(\) failed at bucket \(1, 1\) \(RuntimeError: out of workspace\); a "
        r"runner without every bucket's graph refuses to run \(nothing was written\)"
    )
    with pytest.raises(RuntimeError, match=r"GraphRunner\.run: " + refusal):
        runner.run(fwd, x)
    _assert_same(before, _state_and_buffers(model, runner))
    with pytest.raises(RuntimeError, match=r"GraphRunner\.graph: " + refusal):
        runner.graph(2)
    fail["bucket"] = -1  # fixed: a new capture succeeds and the runner runs
    runner.capture()
    captured.append(runner.captured)
    assert captured == [False, True]
    pool, y_ref = model.oracle(model.state[:SLOTS].clone(), x, [3, 1], [-1, -1], [False] * 2)
    torch.testing.assert_close(runner.run(fwd, x)["y"], y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.state[:SLOTS], pool)


def test_a_step_that_saves_nothing_saves_nothing_under_replay() -> None:
    # has_mamba_track_mask=False with a mask that flags a row: the eager ops save nothing
    # (the flag decides); the graph, captured with the flag on, must not save either.
    cpu = torch.device("cpu")
    model, runner = _setup(cpu)
    x = model.random_inputs(torch.Generator().manual_seed(7), 2)
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(3),
        mamba_cache_indices=torch.tensor([3, 4]),
        mamba_track_indices=torch.tensor([9, -1]),
        mamba_track_mask=torch.tensor([True, False]),
        has_mamba_track_mask=False,
    )
    pool, y_ref = model.oracle(model.state[:SLOTS].clone(), x, [3, 4], [-1, -1], [False] * 2)
    out = runner.run(fwd, x)
    torch.testing.assert_close(out["y"], y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.state[:SLOTS], pool)  # slot 9 untouched


def test_run_refuses_a_step_that_is_not_metadata() -> None:
    _, runner = _setup(torch.device("cpu"))
    with pytest.raises(TypeError, match=r"GraphRunner\.run: step must be a ForwardMetadata"):
        runner.run(None, {})  # type: ignore[arg-type]
