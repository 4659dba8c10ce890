"""Unit tests of the metadata decorator: definition-time rules, generated code, validation."""

from __future__ import annotations

import inspect
import linecache
import traceback

import attrs
import pytest
import torch

from hybridmeta import Mamba2Metadata, debug_mode, fields_of, is_derived, metadata, source_of
from hybridmeta.core import BOOL, INDEX, Pad, field, tensor_field


@metadata
class _Root:
    slots: torch.Tensor = tensor_field(rows="batch", dtypes=INDEX, pad=Pad.value(-1))
    offsets: torch.Tensor = tensor_field(rows="batch+1", dtypes=INDEX, pad=Pad.CUMULATIVE)
    mask: torch.Tensor | None = tensor_field(
        rows="batch", dtypes=BOOL, pad=Pad.value(False), default=None
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
    assert "raise _bad_source(_Cls, _Source, source)" in text


def test_validation_names_field_and_rule() -> None:
    with pytest.raises(
        ValueError, match=r"_Root\.slots dtype must be one of \(int32, int64\), got torch\.float32"
    ):
        _Root(slots=torch.zeros(3), offsets=torch.arange(4))
    with pytest.raises(
        ValueError,
        match=r"_Root\.offsets has 3 rows but its rows are 'batch\+1' and slots implies 4",
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
        slots: torch.Tensor = tensor_field(rows="batch", dtypes=INDEX, pad=Pad.value(-1))
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
