"""The replay state machine: capture -> replay steps of any size -> every invariant holds.

A Mamba2-like decode step (``tests/graphs/toy.py``) is captured per bucket and replayed for
random steps: random ``bs``, random live slots (virtual ids, translated by the buffers),
random track flags. Before each step everything past the live prefix of every static buffer
is poisoned with NaN, random flags and other requests' slot ids. After each replay:

* outputs of live rows equal an eager per-row reference computed on the live rows alone;
* every state slot no live row references is bit-identical to before;
* each flagged row's track slot holds exactly that row's new state, and no other track
  slot changed.

A deliberately defective step (the whole track buffer sliced ``[-num_decodes:]``, sglang
#32555) must make the machine fail, on the CPU emulation and on real CUDA graphs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridmeta.graphs import (
    CudaGraphBackend,
    EmulatedGraphBackend,
    GraphBackend,
    GraphRunner,
    StaticBuffers,
)
from hybridmeta.model import ForwardMetadata
from tests.graphs.toy import KernelMamba, StepModel, ToyMamba
from tests.properties.strategies.graphs import (
    DecodeStepSpec,
    bucket_sets,
    decode_steps,
    poison_fill,
)


class ReplayMachine(RuleBasedStateMachine):
    """Base machine; subclasses pick the device, the backend, the step and its variant."""

    device: ClassVar[str] = "cpu"
    defective: ClassVar[bool] = False
    max_bs_choices: ClassVar[tuple[int, ...]] = (2, 3, 5, 8)

    def __init__(self) -> None:
        super().__init__()
        self.result: dict[str, torch.Tensor] | None = None
        self.spec: DecodeStepSpec | None = None

    def make_backend(self) -> GraphBackend:
        return EmulatedGraphBackend(self.device)

    def teardown(self) -> None:
        # Free this case's graphs now: the machine is in a reference cycle, and the cyclic
        # collector would otherwise free them at an arbitrary later allocation.
        for name in ("runner",):
            self.__dict__.pop(name, None)

    def make_model(self, num_slots: int, max_bs: int, gen: torch.Generator) -> StepModel:
        return ToyMamba(
            num_slots,
            2,
            3,
            gen=gen,
            device=torch.device(self.device),
            defective=self.defective,
            max_bs=max_bs,
        )

    @initialize(data=st.data(), seed=st.integers(0, 2**16))
    def setup(self, data: st.DataObject, seed: int) -> None:
        max_bs = data.draw(st.sampled_from(self.max_bs_choices), label="max_bs")
        self.max_bs = max_bs
        self.num_slots = 2 * max_bs + 3
        gen = torch.Generator().manual_seed(seed)
        dev = torch.device(self.device)
        self.model = self.make_model(self.num_slots, max_bs, gen)
        # Virtual ids (request-pool indices) -> physical slots; the buffers translate.
        self.table = torch.randperm(self.num_slots, generator=gen)
        self.inverse = torch.argsort(self.table)
        self.buffers = StaticBuffers(
            max_bs=max_bs,
            num_slots=self.num_slots,
            device=dev,
            inputs=self.model.input_specs,
            slot_table=self.table.to(dev),
        )
        self.buckets = data.draw(bucket_sets(max_bs), label="buckets")
        self.runner = GraphRunner(
            self.model.step, self.buffers, buckets=self.buckets, backend=self.make_backend()
        )
        before = self.model.state[: self.num_slots].clone()
        self.runner.capture()
        # Capture and warm-up ran on all-pad rows: no real slot changed.
        assert torch.equal(self.model.state[: self.num_slots], before)
        self.last_bs = 0

    def _poison(self, seed: int) -> None:
        # From row 0: refresh must rewrite the live rows and the pad rows [bs:B) itself;
        # rows [B:max_bs) keep the junk, and no captured op may read them.
        self.buffers.poison_(0, poison_fill(seed, self.num_slots))

    def _run(self, spec: DecodeStepSpec) -> None:
        dev = torch.device(self.device)
        bs = spec.bs
        self._poison(spec.seed)
        inputs = self.model.random_inputs(torch.Generator().manual_seed(spec.seed + 1), bs)
        virtual = self.inverse[torch.tensor(spec.slots)]
        fwd = ForwardMetadata(
            query_start_loc=torch.arange(bs + 1).to(dev),
            mamba_cache_indices=virtual.to(dev),
            mamba_track_indices=torch.tensor(spec.track).to(dev),
            mamba_track_mask=torch.tensor(spec.mask).to(dev),
            has_mamba_track_mask=any(spec.mask),
        )
        before = self.model.state[: self.num_slots].cpu()
        pool, y_ref = self.model.oracle(
            before, inputs, list(spec.slots), list(spec.track), list(spec.mask)
        )
        out = self.runner.run(fwd, {k: v.to(dev) for k, v in inputs.items()})
        self.result = {
            "before": before,
            "expected": pool,
            "y_ref": y_ref,
            "y": out["y"].cpu(),
            "after": self.model.state[: self.num_slots].cpu(),
        }
        self.spec = spec
        self.last_bs = bs

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._run(
            data.draw(decode_steps(num_slots=self.num_slots, max_bs=self.max_bs), label="step")
        )

    @precondition(lambda self: self.last_bs > 1)
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        spec = data.draw(
            decode_steps(num_slots=self.num_slots, max_bs=self.last_bs - 1), label="shrink"
        )
        self._run(spec)

    @precondition(lambda self: 0 < self.last_bs < self.max_bs)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        spec = data.draw(
            decode_steps(num_slots=self.num_slots, max_bs=self.max_bs, min_bs=self.last_bs + 1),
            label="grow",
        )
        self._run(spec)

    @invariant()
    def live_outputs_match_reference(self) -> None:
        if self.result is None:
            return
        assert self.result["y"].shape == self.result["y_ref"].shape
        # exact models: y sums 3 products per head, possibly in another order in the batched
        # step than in the row-at-a-time oracle: <= 2 * 2**-24 * sum|terms| ~ 1e-6 for
        # |terms| <= ~5; 1e-5 covers it. The Triton model: the kernel table's fp32 bound.
        tol = 1e-5 if self.model.exact else 1e-3
        torch.testing.assert_close(self.result["y"], self.result["y_ref"], rtol=tol, atol=tol)

    @invariant()
    def unreferenced_slots_bit_identical(self) -> None:
        if self.result is None or self.spec is None:
            return
        touched = set(self.spec.slots) | {
            t for t, m in zip(self.spec.track, self.spec.mask, strict=True) if m
        }
        keep = torch.tensor([s not in touched for s in range(self.num_slots)])
        after, before = self.result["after"], self.result["before"]
        changed = sorted(
            s for s in range(self.num_slots) if keep[s] and not torch.equal(after[s], before[s])
        )
        assert not changed, f"unreferenced state slots changed: {changed}"

    @invariant()
    def working_and_track_slots_exact(self) -> None:
        if self.result is None or self.spec is None:
            return
        after, expected = self.result["after"], self.result["expected"]
        for slot in self.spec.slots:
            assert _same(after[slot], expected[slot], self.model.exact), f"working slot {slot}"
        for row, (t, m) in enumerate(zip(self.spec.track, self.spec.mask, strict=True)):
            if m:
                assert _same(after[t], expected[t], self.model.exact), (
                    f"track slot {t} of flagged row {row} does not hold the row's new state"
                )


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(got, want)
    # fp32 kernel tolerances (mamba_ssm's): exp / reductions may round differently.
    return torch.allclose(got, want, rtol=3e-4, atol=1e-3)


class _CudaMachine(ReplayMachine):
    device = "cuda"

    def make_backend(self) -> GraphBackend:
        return CudaGraphBackend(self.device)


class _DefectiveEmulated(ReplayMachine):
    defective = True


class _DefectiveCuda(_CudaMachine):
    defective = True


class _KernelMixin(ReplayMachine):
    """The Triton SSM decode kernel (fused track-save) instead of the pure-torch step."""

    def make_model(self, num_slots: int, max_bs: int, gen: torch.Generator) -> StepModel:
        return KernelMamba(
            num_slots,
            2,
            4,
            4,
            gen=gen,
            device=torch.device(self.device),
            defective=self.defective,
            max_bs=max_bs,
        )


class _KernelEmulated(_KernelMixin):
    # The Triton interpreter is slow: small batches on the CPU.
    max_bs_choices = (2, 3, 4)


class _KernelDefectiveEmulated(_KernelEmulated):
    defective = True


class _KernelCuda(_KernelMixin, _CudaMachine):
    pass


class _KernelDefectiveCuda(_KernelCuda):
    defective = True


def _ci(**kw: Any) -> settings:
    return settings(settings.default, stateful_step_count=8, **kw)


def _find_defect(parent: settings) -> settings:
    # Stop at the first failing example: no shrinking, one error (not an ExceptionGroup).
    return settings(
        parent,
        max_examples=200,
        database=None,
        report_multiple_bugs=False,
        phases=(Phase.generate,),
    )


def test_replay_machine_emulated() -> None:
    run_state_machine_as_test(ReplayMachine, settings=_ci())


def test_defective_step_fails_the_machine_emulated() -> None:
    with pytest.raises(AssertionError, match="slot"):
        run_state_machine_as_test(_DefectiveEmulated, settings=_find_defect(_ci()))


def _kernel_ci(**kw: Any) -> settings:
    # Each interpreted kernel launch costs ~0.1 s on the CPU: a handful of short runs.
    return settings(settings.default, max_examples=4, stateful_step_count=4, **kw)


@pytest.mark.interpreter
def test_replay_machine_emulated_triton_kernel() -> None:
    run_state_machine_as_test(_KernelEmulated, settings=_kernel_ci())


@pytest.mark.interpreter
def test_defective_kernel_step_fails_the_machine_emulated() -> None:
    with pytest.raises(AssertionError, match="slot"):
        run_state_machine_as_test(
            _KernelDefectiveEmulated,
            settings=settings(_find_defect(_kernel_ci()), max_examples=40),
        )


_THOROUGH = settings(settings.get_profile("thorough"), stateful_step_count=12)


@pytest.mark.gpu
def test_replay_machine_cuda_graphs() -> None:
    run_state_machine_as_test(_CudaMachine, settings=_THOROUGH)


@pytest.mark.gpu
def test_defective_step_fails_the_machine_cuda_graphs() -> None:
    with pytest.raises(AssertionError, match="slot"):
        run_state_machine_as_test(_DefectiveCuda, settings=_find_defect(_THOROUGH))


@pytest.mark.gpu
def test_replay_machine_cuda_graphs_triton_kernel() -> None:
    run_state_machine_as_test(_KernelCuda, settings=_THOROUGH)


@pytest.mark.gpu
def test_defective_kernel_step_fails_the_machine_cuda_graphs() -> None:
    with pytest.raises(AssertionError, match="slot"):
        run_state_machine_as_test(_KernelDefectiveCuda, settings=_find_defect(_THOROUGH))
