"""The verify + commit replay state machine: graphs bucketed over ``(B, T)`` ignore stale tails.

Two captured steps per bucket ``(B, T)``, each over its own static buffers: the verify step
(one Mamba2 layer: ``conv_verify_update_from_metadata`` and
``ssm_verify_update_from_metadata``, intermediate states into ``inter[:B, :T]``) and the
commit step (``spec_commit_from_metadata`` over a ``SpecCommitMetadata``). Steps have random
``bs <= max_bs``, random ``T <= max_draft`` (replayed in the smallest captured draft bucket,
so some steps pad their draft columns), random trees (or chains), random verdicts
(accepted columns, ``-1`` included) and random track boundaries. Before every step each
static buffer is poisoned whole (NaN inputs, random flags, other requests' slot ids, both
in rows past ``bs`` and in columns past ``T``) and so are the intermediate-state buffers.
After each step:

* live outputs of every draft token equal an eager run of the same ops on the live rows
  alone (compact tensors: no buffer, no tail) -- graph replay of verify + commit equals
  eager;
* every working slot and every flagged row's track slot holds exactly what the eager
  commit wrote; every other state slot is bit-identical to before.

Defective verify steps that read the full ``max_bs x max_draft`` static buffers (the working
slots sliced ``[-B:]`` of the whole buffer, sglang #32555's pattern; the tree read from the
last ``T`` of all ``max_draft`` columns) must fail the machine, on the CPU emulation and on
real CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
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

from hybridmeta import TOKENS, ForwardMetadata, prepare_target_verify
from hybridmeta.graphs import (
    CudaGraphBackend,
    EmulatedGraphBackend,
    GraphBackend,
    GraphRunner,
    InputSpec,
    StaticBuffers,
)
from hybridmeta.kernels import (
    Impl,
    conv_verify_update,
    conv_verify_update_from_metadata,
    spec_commit,
    spec_commit_from_metadata,
    ssm_verify_update,
    ssm_verify_update_from_metadata,
)
from hybridmeta.model import Mamba2Metadata, SpecCommitMetadata
from tests.properties.strategies.graphs import (
    VerifyStepSpec,
    bucket_sets,
    draft_bucket_sets,
    poison_fill,
    verify_steps,
)

H, P, N, G, CD, K = 2, 2, 3, 1, 3, 3
F32 = torch.float32


class SpecLayer:
    """One Mamba2 layer's state (layer-major pools of one layer), its intermediate-state
    buffers and the two captured steps. ``defect``: ``None``, ``"rows"`` or ``"cols"``."""

    def __init__(
        self,
        num_slots: int,
        max_bs: int,
        max_draft: int,
        *,
        gen: torch.Generator,
        device: torch.device,
        impl: Impl,
        defect: str | None,
    ) -> None:
        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device)

        self.ssm = rnd(1, num_slots, H, P, N)
        self.conv = rnd(1, num_slots, CD, K - 1)
        self.inter_ssm = torch.empty(1, max_bs, max_draft, H, P, N, device=device)
        self.inter_conv = torch.empty(1, max_bs, max_draft, CD, K - 1, device=device)
        self.A = (-torch.rand(H, generator=gen) - 0.1).to(device)
        self.D = rnd(H)
        self.weight = rnd(CD, K)
        self.bias = rnd(CD)
        self.max_bs, self.max_draft = max_bs, max_draft
        self.impl: Impl = impl
        self.defect = defect

    input_specs: ClassVar[dict[str, InputSpec]] = {
        "x": InputSpec((H, P), F32, rows=TOKENS),
        "dt": InputSpec((H,), F32, rows=TOKENS),
        "B": InputSpec((G, N), F32, rows=TOKENS),
        "C": InputSpec((G, N), F32, rows=TOKENS),
        "xc": InputSpec((CD,), F32, rows=TOKENS),
    }

    def poison_inter(self) -> None:
        self.inter_ssm.fill_(float("nan"))
        self.inter_conv.fill_(float("nan"))

    def verify(self, md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        B, T = md.num_decodes, md.draft_token_num
        grid = {k: v.view(B, T, *v.shape[1:]) for k, v in ins.items()}
        inter_s, inter_c = self.inter_ssm[0, :B, :T], self.inter_conv[0, :B, :T]
        if self.defect is None:
            yc = conv_verify_update_from_metadata(
                md, grid["xc"], self.conv[0], self.weight, self.bias, inter=inter_c, impl=self.impl
            )
            y = ssm_verify_update_from_metadata(
                md, self.ssm[0], grid["x"], grid["dt"], self.A, grid["B"], grid["C"], D=self.D,
                dt_softplus=True, inter=inter_s, impl=self.impl,
            )  # fmt: skip
        else:
            slots, parent = self._defective(md)
            yc = conv_verify_update(
                grid["xc"], self.conv[0], self.weight, self.bias, cache_indices=slots,
                parent=parent, inter=inter_c, impl=self.impl,
            )  # fmt: skip
            y = ssm_verify_update(
                self.ssm[0], grid["x"], grid["dt"], self.A, grid["B"], grid["C"], D=self.D,
                dt_softplus=True, state_indices=slots, parent=parent, inter=inter_s,
                impl=self.impl,
            )  # fmt: skip
        return {"y": y.reshape(B * T, H, P), "yc": yc.reshape(B * T, CD)}

    def _defective(self, md: Mamba2Metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = md.num_decodes, md.draft_token_num
        slots, parent = md.mamba_cache_indices, md.retrieve_parent_token
        if self.defect == "rows":
            # The whole max_bs buffer, then its last B rows.
            whole = torch.as_strided(slots, (self.max_bs,), (slots.stride(0),), slots.storage_offset())
            slots = whole[-B:]
        elif self.defect == "cols":
            # The tree's whole max_draft columns, then the last T of them.
            assert parent is not None
            whole = torch.as_strided(
                parent, (B, self.max_draft), parent.stride(), parent.storage_offset()
            )
            parent = whole[:, -T:]
        return slots, parent

    def commit(self, md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert isinstance(md, SpecCommitMetadata)
        B, T = md.num_decodes, md.draft_token_num
        spec_commit_from_metadata(
            md, self.conv, self.ssm, self.inter_conv[:, :B, :T], self.inter_ssm[:, :B, :T],
            impl=self.impl,
        )  # fmt: skip
        return {}


def _inputs(gen: torch.Generator, bs: int, T: int) -> dict[str, torch.Tensor]:
    n = bs * T
    return {
        "x": torch.randn(n, H, P, generator=gen),
        "dt": torch.rand(n, H, generator=gen) - 0.5,
        "B": torch.randn(n, G, N, generator=gen),
        "C": torch.randn(n, G, N, generator=gen),
        "xc": torch.randn(n, CD, generator=gen),
    }


class SpecReplayMachine(RuleBasedStateMachine):
    """Base machine; subclasses pick the device, backend, implementation and defect."""

    device: ClassVar[str] = "cpu"
    impl: ClassVar[Impl] = "reference"
    defect: ClassVar[str | None] = None
    max_bs_choices: ClassVar[tuple[int, ...]] = (2, 3, 5)
    max_draft_choices: ClassVar[tuple[int, ...]] = (1, 2, 3)
    trees_choices: ClassVar[tuple[bool, ...]] = (False, True)

    def __init__(self) -> None:
        super().__init__()
        self.result: dict[str, Any] | None = None
        self.last_bs = 0

    def make_backend(self) -> GraphBackend:
        return EmulatedGraphBackend(self.device)

    def teardown(self) -> None:
        # Free this case's graphs now: the machine is in a reference cycle, and the cyclic
        # collector would otherwise free them at an arbitrary later allocation.
        for name in ("verify", "commit"):
            self.__dict__.pop(name, None)

    @initialize(data=st.data(), seed=st.integers(0, 2**16))
    def setup(self, data: st.DataObject, seed: int) -> None:
        self.max_bs = data.draw(st.sampled_from(self.max_bs_choices), label="max_bs")
        self.max_draft = data.draw(st.sampled_from(self.max_draft_choices), label="max_draft")
        self.trees = data.draw(st.sampled_from(self.trees_choices), label="trees")
        self.num_slots = 2 * self.max_bs + 3
        dev = torch.device(self.device)
        gen = torch.Generator().manual_seed(seed)
        self.layer = SpecLayer(
            self.num_slots, self.max_bs, self.max_draft, gen=gen, device=dev, impl=self.impl,
            defect=self.defect,
        )  # fmt: skip
        # Virtual ids (request-pool indices) -> physical slots; the buffers translate.
        self.table = torch.randperm(self.num_slots, generator=gen)
        self.inverse = torch.argsort(self.table)
        optional = ["mamba_track_indices", "mamba_track_mask"]
        if self.trees:
            optional.append("retrieve_parent_token")
        common: dict[str, Any] = {
            "max_bs": self.max_bs,
            "num_slots": self.num_slots,
            "device": dev,
            "max_draft": self.max_draft,
            "static": {"is_target_verify": True},
            "optional_fields": optional,
            "slot_table": self.table.to(dev),
        }
        self.vbuf = StaticBuffers(inputs=self.layer.input_specs, **common)
        self.cbuf = StaticBuffers(metadata_class=SpecCommitMetadata, **common)
        buckets = data.draw(bucket_sets(self.max_bs), label="buckets")
        drafts = data.draw(draft_bucket_sets(self.max_draft), label="draft_buckets")
        backend = self.make_backend()
        self.verify = GraphRunner(
            self.layer.verify, self.vbuf, buckets=buckets, draft_buckets=drafts, backend=backend
        )
        self.commit = GraphRunner(
            self.layer.commit, self.cbuf, buckets=buckets, draft_buckets=drafts, backend=backend
        )
        before = (self.layer.ssm.clone(), self.layer.conv.clone())
        self.verify.capture()
        self.commit.capture()
        # Capture and warm-up ran on all-pad rows: no real slot changed.
        assert torch.equal(self.layer.ssm, before[0]) and torch.equal(self.layer.conv, before[1])

    def _poison(self, seed: int) -> None:
        # Whole buffers (slot-id columns: other requests' slots, parents and columns):
        # refresh must rewrite the live corner and the pad itself; rows past B and columns
        # past T keep the junk, and no captured op may read them.
        fill = poison_fill(seed, self.num_slots)
        self.vbuf.poison_(0, fill)
        self.cbuf.poison_(0, fill)
        self.layer.poison_inter()

    def _run(self, spec: VerifyStepSpec) -> None:
        dev = torch.device(self.device)
        s, bs, T = spec.step, spec.bs, spec.T
        self._poison(s.seed)
        ins = _inputs(torch.Generator().manual_seed(s.seed + 1), bs, T)
        mask = torch.tensor(s.mask)
        fwd = ForwardMetadata(
            query_start_loc=(torch.arange(bs + 1) * T).to(dev),
            mamba_cache_indices=self.inverse[torch.tensor(s.slots)].to(dev),
            mamba_track_indices=torch.tensor(s.track).to(dev),
            mamba_track_mask=mask.to(dev),
            has_mamba_track_mask=any(s.mask),
            is_target_verify=True,
            draft_token_num=T,
            retrieve_parent_token=(
                torch.tensor(spec.parents).to(dev) if spec.parents is not None else None
            ),
        )
        cmd = SpecCommitMetadata.evolve_from(
            prepare_target_verify(fwd),
            accepted_index=torch.tensor(spec.accepted).to(dev),
            track_token=torch.tensor(spec.track_token).to(dev),
        )
        before = (self.layer.ssm.cpu(), self.layer.conv.cpu())
        expected = self._eager(spec, ins, before)
        out = self.verify.run(fwd, {k: v.to(dev) for k, v in ins.items()})
        self.commit.run(cmd)
        self.result = {
            "spec": spec,
            "before": before,
            "expected": expected,
            "y": out["y"].cpu(),
            "yc": out["yc"].cpu(),
            "after": (self.layer.ssm.cpu(), self.layer.conv.cpu()),
        }
        self.last_bs = bs

    def _eager(
        self, spec: VerifyStepSpec, ins: Mapping[str, torch.Tensor], pools: tuple[torch.Tensor, ...]
    ) -> dict[str, torch.Tensor]:
        """The same ops on the live rows alone: compact CPU tensors, physical slots, the
        references (no graph, no static buffer, nothing past ``[:bs, :T]``)."""
        s, bs, T = spec.step, spec.bs, spec.T
        lay = self.layer
        ssm, conv = pools[0].clone(), pools[1].clone()
        slots = torch.tensor(s.slots)
        parent = torch.tensor(spec.parents) if spec.parents is not None else None
        g = {k: v.view(bs, T, *v.shape[1:]) for k, v in ins.items()}
        inter_s = torch.empty(1, bs, T, H, P, N)
        inter_c = torch.empty(1, bs, T, CD, K - 1)
        yc = conv_verify_update(
            g["xc"], conv[0], lay.weight.cpu(), lay.bias.cpu(), cache_indices=slots,
            parent=parent, inter=inter_c[0], impl="reference",
        )  # fmt: skip
        y = ssm_verify_update(
            ssm[0], g["x"], g["dt"], lay.A.cpu(), g["B"], g["C"], D=lay.D.cpu(), dt_softplus=True,
            state_indices=slots, parent=parent, inter=inter_s[0], impl="reference",
        )  # fmt: skip
        track: dict[str, Any] = {}
        if any(s.mask):
            track = {"track_indices": torch.tensor(s.track), "track_mask": torch.tensor(s.mask),
                     "track_token": torch.tensor(spec.track_token)}  # fmt: skip
        spec_commit(
            conv, ssm, inter_c, inter_s, state_indices=slots,
            accepted_index=torch.tensor(spec.accepted), impl="reference", **track,
        )  # fmt: skip
        return {"y": y.reshape(bs * T, H, P), "yc": yc.reshape(bs * T, CD), "ssm": ssm, "conv": conv}

    def _draw(self, data: st.DataObject, label: str, **kw: int) -> VerifyStepSpec:
        args = {"num_slots": self.num_slots, "max_bs": self.max_bs, "max_draft": self.max_draft}
        args.update(kw)
        return data.draw(verify_steps(trees=self.trees, **args), label=label)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._run(self._draw(data, "step"))

    @precondition(lambda self: self.last_bs > 1)
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        self._run(self._draw(data, "shrink", max_bs=self.last_bs - 1))

    @precondition(lambda self: 0 < self.last_bs < self.max_bs)
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        self._run(self._draw(data, "grow", min_bs=self.last_bs + 1))

    @invariant()
    def live_outputs_equal_eager(self) -> None:
        if self.result is None:
            return
        r = self.result
        tol = 1e-5 if self.impl == "reference" else 1e-3
        for name in ("y", "yc"):
            got, want = r[name], r["expected"][name]
            assert got.shape == want.shape, f"verify output {name}: shape"
            assert torch.allclose(got, want, rtol=tol, atol=tol), (
                f"verify output {name}: max |diff| {(got - want).abs().max()}"
            )

    @invariant()
    def committed_slots_hold_the_state_and_the_rest_untouched(self) -> None:
        if self.result is None:
            return
        r = self.result
        spec: VerifyStepSpec = r["spec"]
        s = spec.step
        written = {slot for slot, a in zip(s.slots, spec.accepted, strict=True) if a >= 0} | {
            t for t, m, k in zip(s.track, s.mask, spec.track_token, strict=True) if m and k >= 0
        }
        # Not bit-exact even for the reference ops: the graph runs the padded bucket, the
        # eager run the compact rows, and torch's CPU softplus takes its vectorised (Sleef)
        # or scalar (libm) path by position in the tensor, one ulp apart; which one depends on
        # the CPU's vector width. That ulp, carried through <= max_draft tokens, is far below
        # 1e-5; the Triton kernels' own rounding differs more (3e-4 / 1e-3).
        rtol, atol = (1e-5, 1e-5) if self.impl == "reference" else (3e-4, 1e-3)
        for i, pool in enumerate(("ssm", "conv")):
            after, before, want = r["after"][i], r["before"][i], r["expected"][pool]
            for slot in range(self.num_slots):
                if slot in written:
                    ok = torch.allclose(after[:, slot], want[:, slot], rtol=rtol, atol=atol)
                    assert ok, f"{pool} slot {slot} does not hold the committed state"
                else:
                    assert torch.equal(after[:, slot], before[:, slot]), (
                        f"{pool} slot {slot}, which no live row commits to, changed"
                    )


class _Cuda(SpecReplayMachine):
    device = "cuda"

    def make_backend(self) -> GraphBackend:
        return CudaGraphBackend(self.device)


class _RowsDefect(SpecReplayMachine):
    defect = "rows"


class _ColsDefect(SpecReplayMachine):
    defect = "cols"
    trees_choices = (True,)
    max_draft_choices = (2, 3)


class _Triton(SpecReplayMachine):
    # The Triton interpreter runs every program one after another: tiny buckets on the CPU.
    impl = "triton"
    max_bs_choices = (2, 3)
    max_draft_choices = (1, 2)


class _CudaTriton(_Cuda):
    impl = "triton"


class _CudaRowsDefect(_Cuda):
    defect = "rows"


class _CudaColsDefect(_Cuda):
    defect = "cols"
    trees_choices = (True,)
    max_draft_choices = (2, 3, 4)


class _CudaTritonRowsDefect(_CudaTriton):
    defect = "rows"


def _ci(**kw: Any) -> settings:
    # Every example captures |buckets| x |draft buckets| x 2 graphs: half the profile's
    # examples keep the CPU run short; the GPU run takes the thorough profile.
    base = settings.default
    assert base is not None
    n = max(base.max_examples // 2, 10)
    return settings(base, max_examples=n, stateful_step_count=6, **kw)


def _find_defect(parent: settings) -> settings:
    # Stop at the first failing example: no shrinking, one error (not an ExceptionGroup).
    return settings(
        parent, max_examples=200, database=None, report_multiple_bugs=False,
        phases=(Phase.generate,),
    )  # fmt: skip


def test_spec_replay_machine_emulated() -> None:
    run_state_machine_as_test(SpecReplayMachine, settings=_ci())


@pytest.mark.parametrize("machine", [_RowsDefect, _ColsDefect], ids=["rows", "cols"])
def test_full_buffer_verify_step_fails_the_machine_emulated(machine: type[SpecReplayMachine]) -> None:
    with pytest.raises(AssertionError, match=r"verify output|slot"):
        run_state_machine_as_test(machine, settings=_find_defect(_ci()))


@pytest.mark.interpreter
def test_spec_replay_machine_emulated_triton_kernels() -> None:
    run_state_machine_as_test(
        _Triton, settings=settings(settings.default, max_examples=3, stateful_step_count=3)
    )


_THOROUGH = settings(settings.get_profile("thorough"), stateful_step_count=10)


@pytest.mark.gpu
@pytest.mark.parametrize("machine", [_Cuda, _CudaTriton], ids=["reference", "triton"])
def test_spec_replay_machine_cuda_graphs(machine: type[SpecReplayMachine]) -> None:
    run_state_machine_as_test(machine, settings=settings(_THOROUGH, max_examples=50))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "machine", [_CudaRowsDefect, _CudaColsDefect, _CudaTritonRowsDefect],
    ids=["rows", "cols", "triton-rows"],
)  # fmt: skip
def test_full_buffer_verify_step_fails_the_machine_cuda_graphs(
    machine: type[SpecReplayMachine],
) -> None:
    with pytest.raises(AssertionError, match=r"verify output|slot"):
        run_state_machine_as_test(machine, settings=_find_defect(_THOROUGH))
