"""hybridmeta's Triton kernels driven through the replay harness (interpreter / CUDA)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings

from examples.triton_backend.backend import KernelBackend
from hybridmeta.testing import ReplayFailure, TailFill, check_replay, resolve_settings


def _cpu_settings(examples: int) -> settings:
    # Each interpreted kernel launch costs ~0.1 s on the CPU: a handful of short runs.
    return settings(resolve_settings(), max_examples=examples, stateful_step_count=3)


@pytest.mark.interpreter
def test_kernels_pass_the_replay_harness_on_the_emulation() -> None:
    check_replay(KernelBackend, settings=_cpu_settings(4))


@pytest.mark.interpreter
def test_the_captured_graph_replays_the_triton_ops() -> None:
    from hybridmeta.testing.replay import _ReplayBase, replay_machine

    machine = replay_machine(KernelBackend)()
    assert isinstance(machine, _ReplayBase)
    machine.capture()
    ops = [str(op.func) for op in machine._graphs[1]._ops]  # type: ignore[attr-defined]
    assert any("hybridmeta.ssm_state_update" in o for o in ops), ops
    assert any("hybridmeta.causal_conv1d_update" in o for o in ops), ops


@pytest.mark.interpreter
def test_stale_tail_on_the_kernels_is_found_on_the_emulation() -> None:
    # Find it, do not shrink it (shrinking re-runs interpreted kernels many times).
    find = settings(_cpu_settings(30), phases=(Phase.generate,), database=None)
    with pytest.raises(ReplayFailure, match="static buffer 'mamba_track_indices' lie past"):
        check_replay(lambda: KernelBackend(stale_tail=True), settings=find,
                     fills=[TailFill.ZEROS])  # fmt: skip


def _cuda() -> KernelBackend:
    return KernelBackend(max_bs=8, num_slots=20, device="cuda")


@pytest.mark.gpu
def test_kernels_pass_the_replay_harness_with_cuda_graphs() -> None:
    assert torch.cuda.is_available()
    check_replay(_cuda, settings=settings.get_profile("hybridmeta-thorough"))


@pytest.mark.gpu
def test_stale_tail_on_the_kernels_is_found_with_cuda_graphs() -> None:
    def defective() -> KernelBackend:
        return KernelBackend(max_bs=8, num_slots=20, device="cuda", stale_tail=True)

    with pytest.raises(ReplayFailure, match="static buffer 'mamba_track_indices' lie past"):
        check_replay(defective, settings=settings.get_profile("hybridmeta-thorough"))
