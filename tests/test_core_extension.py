"""Engines extend the metadata: extension classes, specialisations, declared conventions,
host-field types (``hybridmeta.core``).

The reproduction of sglang's forward metadata below has 32 fields: hybridmeta's 12 plus 20
of the engine's own (GDN and KDA slots, ReplaySSM cursors, prefill-cache track plans,
checkpoints), declared as an extension of ``ForwardMetadata``; the field-flow property
then follows every one of them through each constructor of the derived metadata.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

from hybridmeta import (
    BATCH,
    BOOL,
    INDEX,
    Conventions,
    ForwardMetadata,
    Mamba2Metadata,
    Pad,
    Role,
    RowOrder,
    SpecCommitMetadata,
    check_values,
    conventions_of,
    debug_mode,
    field,
    fields_of,
    is_derived,
    is_extension,
    metadata,
    prepare_commit,
    prepare_decode,
    prepare_target_verify,
    source_of,
    specialized,
    tensor_field,
)
from hybridmeta.core import Dim
from hybridmeta.testing.strategies import metadata_instances

_ENGINE_ROWS = Dim("engine_rows")


def _opt_rows(role: Role = Role.ENGINE_ONLY, dtypes: tuple[torch.dtype, ...] = INDEX) -> Any:
    pad = None if role.is_slot else Pad.value(False if dtypes == BOOL else 0)
    return tensor_field(rows=BATCH, dtypes=dtypes, pad=pad, role=role, default=None)


def _opt_free() -> Any:
    return tensor_field(dtypes=INDEX, role=Role.ENGINE_ONLY, default=None)


@metadata(extension=True)
class SglangForward(ForwardMetadata):
    """sglang 0.5.23's forward metadata shape: our 12 fields and 20 of the engine's."""

    mamba_cache_indices_gdn: torch.Tensor | None = _opt_rows(Role.SLOT)
    kda_cache_indices: torch.Tensor | None = _opt_rows(Role.SLOT)
    replayssm_write_pos: torch.Tensor | None = _opt_rows()
    replayssm_force_flush: torch.Tensor | None = _opt_rows()
    replayssm_ring_slots: torch.Tensor | None = _opt_rows(Role.SLOT)
    track_conv_indices: torch.Tensor | None = _opt_free()
    track_ssm_h_src: torch.Tensor | None = _opt_free()
    track_ssm_h_dst: torch.Tensor | None = _opt_free()
    track_ssm_final_src: torch.Tensor | None = _opt_free()
    track_ssm_final_dst: torch.Tensor | None = _opt_free()
    checkpoint_slots: torch.Tensor | None = _opt_rows(Role.SLOT)
    checkpoint_mask: torch.Tensor | None = _opt_rows(dtypes=BOOL)
    gdn_track_indices: torch.Tensor | None = _opt_rows(Role.SLOT)
    seq_lens: torch.Tensor | None = _opt_rows()
    extend_prefix_lens: torch.Tensor | None = _opt_rows()
    engine_rows_plan: torch.Tensor | None = tensor_field(
        rows=_ENGINE_ROWS, dtypes=INDEX, role=Role.ENGINE_ONLY, default=None
    )
    use_replayssm: bool = False
    kda_enabled: bool = False
    spec_algorithm: str = "none"
    mamba_track_interval: int = 256


def test_the_reproduction_has_sglangs_32_fields() -> None:
    names = [s.name for s in fields_of(SglangForward)]
    assert len(names) == 32 and len(set(names)) == 32
    assert names[: len(fields_of(ForwardMetadata))] == [s.name for s in fields_of(ForwardMetadata)]
    assert is_extension(SglangForward) and not is_derived(SglangForward)
    assert source_of(SglangForward) is None


def _slots(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _fwd(**kw: Any) -> SglangForward:
    return SglangForward(query_start_loc=_slots(0, 1, 2, 3), mamba_cache_indices=_slots(4, 2, 7), **kw)


def test_an_extension_is_built_directly_and_validated_from_its_declarations() -> None:
    fwd = _fwd(seq_lens=_slots(5, 6, 7), use_replayssm=True)
    assert fwd.use_replayssm and fwd.mamba_track_interval == 256
    with pytest.raises(ValueError, match=r"SglangForward\.seq_lens has 2 rows but its rows are BATCH"):
        _fwd(seq_lens=_slots(5, 6))
    with pytest.raises(ValueError, match=r"SglangForward\.checkpoint_mask dtype must be one of \(bool\)"):
        _fwd(checkpoint_mask=_slots(1, 0, 1))
    with pytest.raises(TypeError, match=r"SglangForward\.mamba_track_interval must be int, got float"):
        _fwd(mamba_track_interval=256.0)
    with pytest.raises(TypeError, match=r"SglangForward\.spec_algorithm must be str"):
        _fwd(spec_algorithm=None)
    # the base's governing rule applies to the extension too
    with pytest.raises(ValueError, match="has_mamba_track_mask must be stated explicitly"):
        _fwd(mamba_track_indices=_slots(1, -1, 3), mamba_track_mask=torch.tensor([True, False, True]))


def _derive_all(fwd: SglangForward) -> list[Mamba2Metadata]:
    """Every public constructor of derived metadata, from one engine forward."""
    out: list[Mamba2Metadata] = [prepare_decode(fwd)]
    out.append(
        Mamba2Metadata.evolve_from(
            fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3, mixed=None
        )
    )
    return out


def test_derived_metadata_of_an_extension_carries_every_field() -> None:
    fwd = _fwd(
        seq_lens=_slots(5, 6, 7), replayssm_write_pos=_slots(0, 3, 1), use_replayssm=True,
        engine_rows_plan=_slots(9, 9),
    )  # fmt: skip
    for md in _derive_all(fwd):
        cls = type(md)
        assert cls is specialized(Mamba2Metadata, SglangForward)
        assert isinstance(md, Mamba2Metadata) and isinstance(md, SglangForward)
        assert cls.__qualname__ == "Mamba2Metadata[SglangForward]"
        for s in fields_of(SglangForward):
            assert getattr(md, s.name) is getattr(fwd, s.name), s.name
        assert source_of(cls) is SglangForward and is_derived(cls)
    # changing an engine field through evolve_from works like any source field (mypy types
    # Mamba2Metadata.evolve_from for ForwardMetadata: a declared specialisation is typed)
    md2: Any = Mamba2Metadata.evolve_from(
        fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3, mixed=None, use_replayssm=False  # type: ignore[call-arg]
    )
    assert md2.use_replayssm is False and md2.seq_lens is fwd.seq_lens
    with pytest.raises(TypeError, match=r"unknown field\(s\) 'nope'"):
        Mamba2Metadata.evolve_from(
            fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3, mixed=None, nope=1
        )  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"missing derived field\(s\) 'mixed'"):
        Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3)  # type: ignore[call-arg]


def test_specialisations_chain_through_verify_and_commit() -> None:
    fwd = SglangForward(
        query_start_loc=_slots(0, 2, 4), mamba_cache_indices=_slots(3, 1), is_target_verify=True,
        draft_token_num=2, seq_lens=_slots(8, 9),
    )  # fmt: skip
    verify = prepare_target_verify(fwd)
    commit = prepare_commit(verify, accepted_index=_slots(0, 1), track_token=_slots(-1, -1))
    assert isinstance(commit, SpecCommitMetadata) and isinstance(commit, SglangForward)
    assert type(commit) is specialized(SpecCommitMetadata, type(verify))
    assert commit.seq_lens is fwd.seq_lens and commit.accepted_index is not None
    assert source_of(type(commit)) is type(verify)


def test_an_extensions_own_hooks_run_in_every_class_built_from_it() -> None:
    @metadata(extension=True)
    class Hooked(ForwardMetadata):
        budget: int = 1

        def __validate__(self) -> None:
            if self.budget < 0:
                raise ValueError("Hooked.budget must be >= 0")

    ok = Hooked(query_start_loc=_slots(0, 1), mamba_cache_indices=_slots(2))
    with pytest.raises(ValueError, match=r"Hooked.budget must be >= 0"):
        Mamba2Metadata.evolve_from(
            ok, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None, budget=-1  # type: ignore[call-arg]
        )
    # Mamba2Metadata's own hook runs in the specialisation too
    with pytest.raises(ValueError, match="num_prefills \\+ num_decodes = 2"):
        Mamba2Metadata.evolve_from(ok, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None)


def test_a_declared_specialisation_adds_fields_and_is_separate_from_the_generated_one() -> None:
    @metadata
    class SglangMamba2(Mamba2Metadata, SglangForward):
        layer_budget: int

    fwd = _fwd(seq_lens=_slots(1, 2, 3))
    md = SglangMamba2.evolve_from(
        fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3, mixed=None, layer_budget=4
    )
    assert md.layer_budget == 4 and md.seq_lens is fwd.seq_lens
    assert type(prepare_decode(fwd)) is not SglangMamba2
    with pytest.raises(TypeError, match=r"missing derived field\(s\) 'layer_budget'"):
        SglangMamba2.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=3, mixed=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes no default"):

        @metadata
        class _Defaulted(Mamba2Metadata, SglangForward):
            x: int = 1


def test_sources_that_are_not_extensions_are_refused() -> None:
    class Undecorated(ForwardMetadata):
        pass

    with pytest.raises(TypeError, match="Undecorated subclasses the metadata class ForwardMetadata"):
        Undecorated(query_start_loc=_slots(0, 1), mamba_cache_indices=_slots(2))

    class UndecoratedDerived(Mamba2Metadata):
        pass

    fwd = ForwardMetadata(query_start_loc=_slots(0, 1), mamba_cache_indices=_slots(2))
    with pytest.raises(TypeError, match="UndecoratedDerived subclasses the metadata class Mamba2Metadata"):
        UndecoratedDerived.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)
    with pytest.raises(TypeError, match=r"source must be a ForwardMetadata .* or a @metadata class extending it, got int"):
        Mamba2Metadata.evolve_from(1, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)  # type: ignore[arg-type]
    md = prepare_decode(fwd)
    assert type(md) is Mamba2Metadata
    with pytest.raises(TypeError, match=r"source must be a Mamba2Metadata .* got ForwardMetadata"):
        SpecCommitMetadata.evolve_from(fwd, accepted_index=_slots(0), track_token=_slots(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"source must be a ForwardMetadata .* got Mamba2Metadata"):
        # a derived instance is no source of its own class: derive from its source
        Mamba2Metadata.evolve_from(md, num_prefills=0, num_prefill_tokens=0, num_decodes=1, mixed=None)


def test_declaration_errors_name_the_class_and_rule() -> None:
    with pytest.raises(TypeError, match=r"an extension .* extends exactly one root or extension"):

        @metadata(extension=True)
        class _ExtOfDerived(Mamba2Metadata):
            x: int = 0

    with pytest.raises(TypeError, match="conventions are declared on a root or extension class"):

        @metadata(conventions=Conventions(null_slot=0))
        class _ConvOnDerived(Mamba2Metadata):
            x: int

    with pytest.raises(TypeError, match=r"specialises a derived class .* for a class extending its source"):

        @metadata
        class _NotASpecialisation(SpecCommitMetadata, SglangForward):
            pass

    with pytest.raises(TypeError, match=r"_Redeclared\.seq_lens: redeclares a field of its base SglangForward"):

        @metadata(extension=True)
        class _Redeclared(SglangForward):
            seq_lens: int = 0  # type: ignore[assignment]

    with pytest.raises(TypeError, match="the pad must be a plain int"):
        tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(float("nan")))
    with pytest.raises(TypeError, match=r"the pad must be True or False"):
        tensor_field(rows=BATCH, dtypes=BOOL, pad=Pad.value(0))
    with pytest.raises(TypeError, match=r"ndim=0\): a field with rows=BATCH needs at least 1"):
        tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), ndim=0)
    with pytest.raises(TypeError, match=r"Conventions.row_order must be a RowOrder"):
        Conventions(row_order="decodes_first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Conventions.null_slot must be a plain int >= -1"):
        Conventions(null_slot=-2)


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class VllmLike(ForwardMetadata):
    seq_lens: torch.Tensor | None = _opt_rows()


def test_conventions_are_declared_once_and_inherited() -> None:
    conv = conventions_of(VllmLike)
    assert conv.null_slot == 0 and conv.decodes_first
    assert conventions_of(ForwardMetadata) == Conventions()
    md = prepare_decode(VllmLike(query_start_loc=_slots(0, 1, 2), mamba_cache_indices=_slots(3, 5)))
    assert conventions_of(md) == conv and md.conventions == conv
    # the slot fields' pad is the declared null slot, in the source and every derived class
    for cls in (VllmLike, type(md)):
        pads = {s.name: s.pad for s in fields_of(cls) if s.role.is_slot}
        assert pads == {"mamba_cache_indices": Pad.value(0), "mamba_track_indices": Pad.value(0)}
    assert {s.name: s.pad for s in fields_of(ForwardMetadata) if s.role.is_slot}[
        "mamba_cache_indices"
    ] == Pad.value(-1)


def _mixed_like(cls: type, nd: int, np_: int, ntok: int) -> Any:
    """A metadata stand-in with the row counts the row-order methods read."""

    class _Rows:
        num_decodes = nd
        num_prefills = np_
        num_prefill_tokens = ntok
        draft_token_num = 1

    obj = _Rows()
    for name in ("prefill_rows", "decode_rows", "prefill_tokens", "decode_tokens"):
        setattr(obj, name, getattr(cls, name).__get__(obj))
    return obj


@pytest.mark.parametrize("order", list(RowOrder))
def test_row_ranges_follow_the_declared_order(order: RowOrder, monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridmeta.model as model

    monkeypatch.setattr(model, "conventions_of", lambda _obj: Conventions(row_order=order))
    rows = _mixed_like(Mamba2Metadata, nd=3, np_=2, ntok=9)
    if order is RowOrder.DECODES_FIRST:
        assert (rows.decode_rows(), rows.prefill_rows()) == (slice(0, 3), slice(3, 5))
        assert (rows.decode_tokens(), rows.prefill_tokens()) == (slice(0, 3), slice(3, 12))
    else:
        assert (rows.prefill_rows(), rows.decode_rows()) == (slice(0, 2), slice(2, 5))
        assert (rows.prefill_tokens(), rows.decode_tokens()) == (slice(0, 9), slice(9, 12))


def test_the_debug_checker_reads_the_declared_null_slot() -> None:
    live = VllmLike(query_start_loc=_slots(0, 1, 2, 3), mamba_cache_indices=_slots(3, 5, 0))
    with pytest.raises(ValueError, match=r"holds the pad value 0 in live row 2"):
        check_values(live, live=True)
    with pytest.raises(ValueError, match=r"must be the null slot 0 \(pad\) or a slot >= 0; row 1 holds -1"):
        check_values(VllmLike(query_start_loc=_slots(0, 1, 2), mamba_cache_indices=_slots(3, -1)))
    # -1 is the pad of the default conventions, and two pad rows are no duplicate
    check_values(ForwardMetadata(query_start_loc=_slots(0, 1, 2, 2), mamba_cache_indices=_slots(3, -1, -1)))
    check_values(VllmLike(query_start_loc=_slots(0, 1, 2, 2), mamba_cache_indices=_slots(3, 0, 0)))
    with debug_mode(), pytest.raises(ValueError, match=r"VllmLike.mamba_cache_indices has a duplicate slot"):
        VllmLike(query_start_loc=_slots(0, 1, 2), mamba_cache_indices=_slots(3, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"has_mamba_track_mask": "False"}, r"has_mamba_track_mask must be bool, got str 'False'"),
        ({"is_target_verify": torch.tensor(True)}, r"is_target_verify must be bool, got torch\.Tensor .*0-d tensor"),
        ({"draft_token_num": 1.5}, r"draft_token_num must be int, got float 1\.5"),
        ({"draft_token_num": True}, r"draft_token_num must be int, got bool True"),
        ({"draft_token_num": np.int64(1)}, r"draft_token_num must be int, got numpy\.int64"),
        ({"mamba_cache_indices": [1, 2]}, r"mamba_cache_indices must be a torch\.Tensor, got list"),
        ({"mamba_cache_indices": np.array([1, 2], dtype=np.int32)}, r"mamba_cache_indices must be a torch\.Tensor, got numpy\.ndarray"),
    ],
)
def test_host_fields_and_tensors_are_type_checked(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"query_start_loc": _slots(0, 1, 2), "mamba_cache_indices": _slots(3, 4)}
    with pytest.raises(TypeError, match=message):
        ForwardMetadata(**{**base, **kwargs})


def test_derived_host_fields_are_type_checked_on_every_evolve_from() -> None:
    fwd = ForwardMetadata(query_start_loc=_slots(0, 1, 2), mamba_cache_indices=_slots(3, 4))
    with pytest.raises(TypeError, match=r"Mamba2Metadata\.num_decodes must be int, got float 2\.0"):
        Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2.0, mixed=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Mamba2Metadata\.num_prefills must be int, got bool False"):
        Mamba2Metadata.evolve_from(fwd, num_prefills=False, num_prefill_tokens=0, num_decodes=2, mixed=None)


@metadata
class _Unresolvable:
    # an annotation naming a type only a TYPE_CHECKING import would provide: not checked
    handle: NotImportedAnywhere = field(default=None)  # type: ignore[name-defined]  # noqa: F821
    count: int = 0


def test_unresolvable_annotations_are_not_checked_but_the_others_are() -> None:
    assert _Unresolvable(handle=object()).count == 0
    with pytest.raises(TypeError, match=r"_Unresolvable\.count must be int"):
        _Unresolvable(count="1")  # type: ignore[arg-type]


_ENGINE_VALUES = {"spec_algorithm": st.sampled_from(["none", "eagle", "ngram"])}


@given(fwd=metadata_instances(SglangForward, max_bs=4, values=_ENGINE_VALUES))
def test_every_engine_field_flows_through_every_derivation(fwd: SglangForward) -> None:
    """The field-flow property over the 32-field reproduction: each constructor of derived
    metadata (decode, verify, commit) carries every engine field by identity."""
    derived: list[Any] = []
    if fwd.is_target_verify:
        verify = prepare_target_verify(fwd)
        bs = fwd.mamba_cache_indices.shape[0]
        minus = torch.full((bs,), -1, dtype=torch.int64)
        derived += [verify, prepare_commit(verify, accepted_index=minus, track_token=minus)]
    else:
        derived.append(prepare_decode(fwd))
    for md in derived:
        for s in fields_of(SglangForward):
            assert getattr(md, s.name) is getattr(fwd, s.name), (type(md).__qualname__, s.name)


@given(st.data())
def test_generated_specialisations_are_built_once(data: st.DataObject) -> None:
    fwd = data.draw(metadata_instances(SglangForward, max_bs=3, values=_ENGINE_VALUES))
    if fwd.is_target_verify:
        return
    assert type(prepare_decode(fwd)) is type(prepare_decode(fwd)) is specialized(Mamba2Metadata, SglangForward)
