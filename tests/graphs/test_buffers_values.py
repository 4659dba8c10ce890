"""Static buffers: construction messages, debug-mode value checks on physical ids, and the
per-step fast path (the generated check) for steps that pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import debug_mode, metadata
from hybridmeta.model import ForwardMetadata
from tests.graphs.test_buffers import (
    MAX_BS,
    SLOTS,
    _assert_untouched,
    _buffers,
    _poison,
    _snapshot,
    _step,
    _x,
)


@metadata(extension=True)
class _Budgeted(ForwardMetadata):
    """An engine extension with a host field that has no default."""

    budget: int


def test_static_draft_columns_are_refused_naming_the_rule_in_full() -> None:
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers: static 'draft_token_num': draft columns are a bucket dimension "
        r"of the buffers, not a frozen value; pass max_draft \(the widest bucket\) and capture "
        r"one graph per draft length$",
    ):
        _buffers(max_draft=2, static={"is_target_verify": True, "draft_token_num": 2})


def test_a_host_field_without_default_must_be_given_in_static() -> None:
    with pytest.raises(
        ValueError, match=r"^StaticBuffers: static must give 'budget' \(no default\)$"
    ):
        _buffers(source=_Budgeted, optional_fields=())
    assert (
        _buffers(source=_Budgeted, optional_fields=(), static={"budget": 3}).static["budget"] == 3
    )


# Debug mode runs the core's value rules (check_values, with the pool size, on physical ids)
# on every set field, including track fields whose flag is off: the slot check skips those
# (refresh pads them), so these rules are the only ones that see them.
_TABLE = [0, 1, 2, 4, 3, 5, 6, 7]  # virtual 3 -> physical 4
_GATED_OFF: list[tuple[str, list[int] | None, list[int], list[int], list[bool], str]] = [
    (
        "track slot past the pool",
        None,
        [1, 2],
        [SLOTS, -1],
        [False, False],
        r"^StaticBuffers\.refresh: ForwardMetadata\.mamba_track_indices must be -1 \(pad\) or a "
        r"slot >= 0 and < num_slots=16; row 0 holds 16$",
    ),
    (
        "save onto a working slot",
        None,
        [5, 2],
        [2, -1],
        [True, False],
        r"^StaticBuffers\.refresh: ForwardMetadata\.mamba_track_indices slot 2 of a tracked row "
        r"is also the mamba_cache_indices of a row: saving into it would overwrite live state$",
    ),
    (
        "save onto a physical working slot",
        _TABLE,
        [3],
        [4],
        [True],
        r"mamba_track_indices slot 4 of a tracked row is also the mamba_cache_indices",
    ),
]


@pytest.mark.parametrize(
    ("name", "table", "slots", "track", "mask", "match"),
    _GATED_OFF,
    ids=[c[0] for c in _GATED_OFF],
)
def test_debug_mode_checks_set_track_fields_even_with_their_flag_off(
    name: str,
    table: list[int] | None,
    slots: list[int],
    track: list[int],
    mask: list[bool],
    match: str,
) -> None:
    kw: dict[str, Any] = {} if table is None else {"slot_table": torch.tensor(table)}
    buffers = _buffers(**kw)
    _poison(buffers)
    before = _snapshot(buffers)
    step = _step(slots, track, mask, has_mamba_track_mask=False)
    bs = len(slots)
    with debug_mode(), pytest.raises(ValueError, match=match):
        buffers.refresh(step, bs, _x(bs))
    _assert_untouched(before, _snapshot(buffers))
    # Outside debug mode the flag-off fields are not checked, only padded.
    md = buffers.refresh(step, bs, _x(bs))
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == [-1] * bs


def test_an_accepted_step_never_runs_the_one_by_one_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The generated check accepts a valid step by itself (host time per step); the
    # detailed checks run only to name a broken rule.
    buffers = _buffers()
    calls: list[tuple[int, int]] = []
    detailed = buffers._validate_step

    def counted(step: ForwardMetadata, key: tuple[int, int]) -> Any:
        calls.append(key)
        return detailed(step, key)

    monkeypatch.setattr(buffers, "_validate_step", counted)
    md = buffers.refresh(_step([3, 1], [9, -1], [True, False]), 4, _x(2))
    assert md.mamba_cache_indices.tolist() == [3, 1, -1, -1]
    with debug_mode():
        buffers.refresh(_step([5]), MAX_BS, _x(1))
    assert calls == []
    with pytest.raises(ValueError, match=r"bucket must satisfy bs <= bucket <= max_bs \(3 <= 2"):
        buffers.refresh(_step([1, 2, 3]), 2, _x(3))
    assert calls == [(2, 1)]
