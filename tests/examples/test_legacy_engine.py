"""The legacy engine example: the harness finds each seed defect and passes the fixed engine."""

from __future__ import annotations

import pytest
from hypothesis import settings

from examples.legacy_engine.harness import (
    dropped_field_backend,
    fixed_backend,
    stale_tail_backend,
)
from examples.legacy_engine.metadata import (
    ForwardMetadata,
    Mamba2Metadata,
    prepare_decode,
    prepare_decode_dropping,
)
from hybridmeta.audit import audit_paths
from hybridmeta.testing import (
    FieldFlowError,
    ReplayFailure,
    assert_field_flow,
    check_replay,
    resolve_settings,
)

_CI = resolve_settings()


def test_stale_tail_defect_is_found_with_a_shrunk_batch_naming_the_rows() -> None:
    with pytest.raises(ReplayFailure) as info:
        check_replay(stale_tail_backend, settings=_CI)
    text = str(info.value)
    assert "(track slot of row 0) does not hold the eager reference's value" in text
    assert "of static buffer 'track_indices' lie past the" in text
    assert "batch: Batch(bs=1," in text, "shrunk to one row"


def test_fixed_engine_passes_the_replay_harness() -> None:
    check_replay(fixed_backend, settings=_CI)


def test_fixed_engine_passes_with_pad_rows_among_live_rows() -> None:
    check_replay(fixed_backend, settings=settings(_CI, max_examples=20), pad_rows=True)


def test_dropped_field_is_invisible_to_replay_but_found_by_the_flow_checker() -> None:
    # Graph and eager path share the constructor, so they agree with each other ...
    check_replay(dropped_field_backend, settings=settings(_CI, max_examples=10))
    # ... and the field-flow checker names the field.
    with pytest.raises(FieldFlowError) as info:
        assert_field_flow(ForwardMetadata, prepare_decode_dropping, derived=Mamba2Metadata,
                          settings=_CI)  # fmt: skip
    assert info.value.report.dropped == ("has_mamba_track_mask",)
    assert "silently took Mamba2Metadata's default" in str(info.value)


def test_fixed_constructor_passes_the_flow_checker() -> None:
    assert_field_flow(ForwardMetadata, prepare_decode, derived=Mamba2Metadata, settings=_CI)


def test_audit_finds_exactly_the_dropping_constructor() -> None:
    result = audit_paths(["examples"])
    found = [(f.function, f.field, f.default) for f in result.findings]
    assert found == [("prepare_decode_dropping", "has_mamba_track_mask", "False")]
