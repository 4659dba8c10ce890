"""Unit tests of the metadata decorator: definition-time rules, generated code, validation."""

from __future__ import annotations

import inspect
import linecache
import traceback
from typing import Any

import attrs
import pytest
import torch

from hybridmeta import Mamba2Metadata, debug_mode, fields_of, is_derived, metadata, source_of
from hybridmeta.core import (
    BATCH,
    BOOL,
    FLOAT,
    INDEX,
    Dim,
    Pad,
    Role,
    check_values,
    field,
    tensor_field,
)


@metadata
class _Root:
    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))
    offsets: torch.Tensor = tensor_field(rows=BATCH + 1, dtypes=INDEX, pad=Pad.CUMULATIVE)
    mask: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=BOOL, pad=Pad.value(False), default=None
    )
    label: str = "root"


def _root(bs: int = 3) -> _Root:
    return _Root(slots=torch.arange(bs), offsets=torch.arange(bs + 1))


def test_class_is_frozen_slotted_and_keyword_only() -> None:
    r = _root()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        r.label = "x"  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    with pytest.raises(TypeError):
        _Root(torch.arange(3), torch.arange(4))  # type: ignore[call-arg]


def test_init_false_fields_are_refused_at_definition() -> None:
    with pytest.raises(TypeError, match=r"_Bad\.hidden: init=False fields are refused"):

        @metadata
        class _Bad:
            x: int
            hidden: int = attrs.field(init=False, default=0)


def test_derived_field_with_a_default_is_refused_at_definition() -> None:
    with pytest.raises(
        TypeError, match=r"_D\.extra: a field of a derived metadata class takes no default"
    ):

        @metadata
        class _D(_Root):
            extra: int | None = None


def test_the_refusals_an_engine_meets_first_point_to_extensions() -> None:
    # An engine subclassing the root to add its own fields meets these two messages first:
    # both name the declaration that does what it wanted.
    with pytest.raises(TypeError, match=r"takes no default.*@metadata\(extension=True\)"):

        @metadata
        class _D(_Root):
            extra: int | None = None

    @metadata
    class _E(_Root):
        extra: int

    with pytest.raises(TypeError, match=r"cannot be constructed directly.*@metadata\(extension=True\)"):
        _E(label="a", extra=1)  # type: ignore[call-arg]

    # Below a derived class there is no extension to point to: no hint.
    @metadata
    class _F(_E):
        more: int

    with pytest.raises(TypeError, match=r"unless you change it$"):
        _F(label="a", extra=1, more=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"optional one\)$"):

        @metadata
        class _G(_E):
            more: int = 0


def test_derived_class_may_not_redeclare_a_source_field() -> None:
    with pytest.raises(TypeError, match=r"_D\.label: redeclares a field of its source _Root"):

        @metadata
        class _D(_Root):
            label: str


def test_registry_of_sources_and_specs() -> None:
    @metadata
    class _D(_Root):
        extra: int

    assert source_of(_D) is _Root
    assert is_derived(_D)
    assert not is_derived(_Root)
    specs = {s.name: s for s in fields_of(_D)}
    assert specs["slots"].per_row and specs["slots"].pad == Pad.value(-1)
    assert specs["offsets"].pad == Pad.CUMULATIVE
    assert specs["mask"].optional and not specs["slots"].optional
    assert not specs["extra"].is_tensor


def test_generated_code_is_readable_source_in_linecache() -> None:
    src = inspect.getsource(Mamba2Metadata.evolve_from)
    assert "def evolve_from(cls, source, /, *, num_prefills=_MISSING" in src
    assert "has_mamba_track_mask = source.has_mamba_track_mask" in src
    filename = Mamba2Metadata.evolve_from.__code__.co_filename
    assert filename.startswith("<hybridmeta generated evolve_from hybridmeta.model.Mamba2Metadata")
    assert linecache.getline(filename, 1).startswith("def evolve_from(")


def test_traceback_through_generated_code_shows_its_lines() -> None:
    with pytest.raises(TypeError) as info:
        Mamba2Metadata.evolve_from(
            object(),  # type: ignore[arg-type]
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=0,
            mixed=None,
        )
    text = "".join(traceback.format_tb(info.value.__traceback__))
    # the generated line that routes a source of another class, as pdb / tracebacks show it
    assert "return _specialize_for(_Cls, source).evolve_from(source, num_prefills=" in text
    assert "source must be a ForwardMetadata" in str(info.value)


def test_validation_names_field_and_rule() -> None:
    with pytest.raises(
        ValueError, match=r"_Root\.slots dtype must be one of \(int32, int64\), got torch\.float32"
    ):
        _Root(slots=torch.zeros(3), offsets=torch.arange(4))
    with pytest.raises(
        ValueError,
        match=r"_Root\.offsets has 3 rows but its rows are BATCH \+ 1 and slots implies 4",
    ):
        _Root(slots=torch.arange(3), offsets=torch.arange(3))
    with pytest.raises(ValueError, match=r"_Root\.mask has 2 rows"):
        _Root(slots=torch.arange(3), offsets=torch.arange(4), mask=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"_Root\.slots must have 1 dimension\(s\)"):
        _Root(slots=torch.zeros(3, 1, dtype=torch.int64), offsets=torch.arange(4))
    with pytest.raises(ValueError, match=r"_Root\.slots is required \(not optional\) and got None"):
        _Root(slots=None, offsets=torch.arange(4))  # type: ignore[arg-type]


def test_devices_must_agree() -> None:
    meta = torch.device("meta")
    with pytest.raises(ValueError, match=r"_Root\.offsets must be on the same device as slots"):
        _Root(slots=torch.arange(3), offsets=torch.arange(4, device=meta))


def test_debug_checks_run_only_in_debug_mode() -> None:
    calls: list[int] = []

    @metadata
    class _Checked:
        slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))
        n: int = field(default=0)

        def __validate_debug__(self) -> None:
            calls.append(1)
            if bool((self.slots < -1).any()):
                raise ValueError("_Checked.slots must be >= -1")

    _Checked(slots=torch.tensor([-5]))  # no device read outside debug mode
    assert calls == []
    with debug_mode(), pytest.raises(ValueError, match="must be >= -1"):
        _Checked(slots=torch.tensor([-5]))
    assert calls == [1]


def test_post_init_is_reserved() -> None:
    with pytest.raises(TypeError, match="define __validate__"):

        @metadata
        class _P:
            x: int

            def __attrs_post_init__(self) -> None:
                pass


# ----------------------------------------------------------------------- the schema


def test_rows_are_typed_and_strings_are_refused() -> None:
    assert repr(BATCH + 1) == "BATCH + 1"
    assert (BATCH + 1).of(3) == 4
    with pytest.raises(TypeError, match="rows must be a Dim"):
        tensor_field(rows="batch", dtypes=INDEX, pad=Pad.value(-1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs a pad rule: per-row fields are bufferable"):
        tensor_field(rows=BATCH, dtypes=INDEX)


def test_roles_are_checked_at_declaration() -> None:
    with pytest.raises(TypeError, match="slot fields hold int32/int64 ids"):
        tensor_field(rows=BATCH, dtypes=FLOAT, role=Role.WORKING_SLOT)
    with pytest.raises(TypeError, match=r"_BadPad\.s: a slot field's pad is the class's null slot -1"):

        @metadata
        class _BadPad:
            s: torch.Tensor = tensor_field(
                rows=BATCH, dtypes=INDEX, pad=Pad.value(0), role=Role.WORKING_SLOT
            )
    with pytest.raises(TypeError, match="a mask has dtypes=BOOL"):
        tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.TRACK_MASK)
    with pytest.raises(TypeError, match="is a tensor-field role"):
        field(default=False, role=Role.WORKING_SLOT)
    with pytest.raises(TypeError, match="is a host-field role"):
        tensor_field(dtypes=INDEX, role=Role.SUBSUMED_FLAG)


@metadata
class _Cols:
    n: int = field(default=1)
    tree: torch.Tensor | None = tensor_field(
        rows=BATCH, cols="n", dtypes=INDEX, pad=Pad.value(-1), default=None
    )


def test_cols_name_a_host_field_and_are_checked() -> None:
    assert fields_of(_Cols)[1].ndim == 2
    _Cols(n=3, tree=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"_Cols\.tree has 2 columns but its columns are n = 3"):
        _Cols(n=3, tree=torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"cols='missing' must name an int host field"):

        @metadata
        class _Bad:
            t: torch.Tensor = tensor_field(cols="missing", dtypes=INDEX)


@metadata
class _Governed:
    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))
    mask: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=BOOL, pad=Pad.value(False), default=None
    )
    track: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), default=None
    )
    use: bool = field(default=False, governs=("mask", "track"), required_when_set=True)


@metadata
class _GovernedDerived(_Governed):
    extra: int


def test_a_governing_flag_must_be_stated_beside_its_data() -> None:
    mask, track = torch.tensor([True]), torch.tensor([3])
    assert _Governed(slots=torch.tensor([0])).use is False  # no data: the default applies
    assert _Governed(slots=torch.tensor([0]), mask=mask, track=track, use=False).use is False
    with pytest.raises(ValueError, match=r"_Governed\.use must be stated explicitly when mask"):
        _Governed(slots=torch.tensor([0]), mask=mask, track=track)
    with pytest.raises(ValueError, match=r"_Governed\.mask and track are given together"):
        _Governed(slots=torch.tensor([0]), mask=mask, use=True)
    with pytest.raises(ValueError, match=r"_Governed\.use is set, so mask and track are required"):
        _Governed(slots=torch.tensor([0]), use=True)
    with pytest.raises(TypeError, match="a governing flag needs a default"):
        field(governs=("mask",))


def test_evolve_from_that_changes_governed_data_must_restate_the_flag() -> None:
    src = _Governed(slots=torch.tensor([0]))
    mask, track = torch.tensor([True]), torch.tensor([3])
    with pytest.raises(TypeError, match="changes mask / track, which use governs; pass use"):
        _GovernedDerived.evolve_from(src, extra=1, mask=mask, track=track)
    d = _GovernedDerived.evolve_from(src, extra=1, mask=mask, track=track, use=True)
    assert d.use is True and d.mask is mask


def test_derived_class_may_declare_checked_tensor_fields() -> None:
    @metadata
    class _D(_Root):
        rows_plan: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))

    r = _root(3)
    d = _D.evolve_from(r, rows_plan=torch.arange(3))
    assert d.rows_plan.shape == (3,)
    with pytest.raises(ValueError, match=r"_D\.rows_plan has 2 rows but its rows are BATCH"):
        _D.evolve_from(r, rows_plan=torch.arange(2))


def test_an_undecorated_class_in_between_is_refused() -> None:
    class _Mid(_Root):
        pass

    with pytest.raises(TypeError, match=r"its base .*_Mid subclasses a metadata class but is not"):

        @metadata
        class _D(_Mid):
            extra: int


@metadata
class _Slots:
    offsets: torch.Tensor = tensor_field(rows=BATCH + 1, dtypes=INDEX, pad=Pad.CUMULATIVE)
    work: torch.Tensor = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.WORKING_SLOT
    )
    track: torch.Tensor = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.TRACK_SLOT
    )
    mask: torch.Tensor = tensor_field(
        rows=BATCH, dtypes=BOOL, pad=Pad.value(False), role=Role.TRACK_MASK
    )


def _slots(**kw: list[int] | list[bool]) -> _Slots:
    base: dict[str, list[int] | list[bool]] = {
        "offsets": [0, 1, 2],
        "work": [3, 4],
        "track": [5, -1],
        "mask": [True, False],
    }
    base.update(kw)
    return _Slots(**{k: torch.tensor(v) for k, v in base.items()})


@pytest.mark.parametrize(
    ("kw", "opts", "message"),
    [
        ({"offsets": [1, 2, 3]}, {}, r"_Slots\.offsets must start at 0"),
        ({"offsets": [0, 2, 1]}, {}, r"_Slots\.offsets must be non-decreasing"),
        ({"work": [3, -2]}, {}, r"_Slots\.work must be -1 \(pad\) or a slot >= 0; row 1 holds -2"),
        ({"work": [3, 9]}, {"num_slots": 8}, r"work must be .* < num_slots=8; row 1 holds 9"),
        ({"track": [9, -1]}, {"num_slots": 8}, r"_Slots\.track must be .* row 0 holds 9"),
        ({"work": [3, 3]}, {}, r"_Slots\.work has a duplicate slot"),
        ({"work": [3, -1]}, {"live": True}, r"holds the pad value -1 in live row 1"),
        ({"track": [-1, -1]}, {}, r"_Slots\.track is -1 \(none\) in a row whose mask is set"),
        ({"track": [5, 5], "mask": [True, True]}, {}, r"duplicate track slot"),
        ({"track": [4, -1]}, {"physical": True}, r"slot 4 of a tracked row is also the work"),
    ],
)
def test_declared_value_checks(kw: dict[str, Any], opts: dict[str, Any], message: str) -> None:
    md = _slots(**kw)  # construction outside debug mode reads no device value
    with pytest.raises(ValueError, match=message):
        check_values(md, **opts)
    if not opts:
        with debug_mode(), pytest.raises(ValueError, match=message):
            _slots(**kw)


def test_declared_value_checks_pass_on_valid_metadata() -> None:
    md = _slots(work=[3, -1])  # a pad row
    check_values(md, num_slots=8, physical=True)
    # a track slot equal to a working slot is not judged without physical ids
    check_values(_slots(track=[4, -1]))
    with debug_mode():
        _slots(track=[4, -1])


def test_a_user_dim_binds_its_own_length() -> None:
    experts = Dim("experts")

    @metadata
    class _E:
        a: torch.Tensor = tensor_field(rows=experts, dtypes=INDEX)
        b: torch.Tensor = tensor_field(rows=experts + 2, dtypes=INDEX)

    _E(a=torch.arange(3), b=torch.arange(5))
    with pytest.raises(ValueError, match=r"_E\.b has 4 rows but its rows are EXPERTS \+ 2"):
        _E(a=torch.arange(3), b=torch.arange(4))


def test_paired_roles_are_unique_per_class() -> None:
    with pytest.raises(TypeError, match=r"at most one field has role Role\.WORKING_SLOT"):

        @metadata
        class _Two:
            a: torch.Tensor = tensor_field(
                rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.WORKING_SLOT
            )
            b: torch.Tensor = tensor_field(
                rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.WORKING_SLOT
            )
