"""The ``hybridmeta demo`` command."""

from __future__ import annotations

import pytest

from hybridmeta.cli import main


def test_demo_shows_the_metadata_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "the one carrier: Mamba2Metadata (evolve_from) with has_mamba_track_mask=True" in out
    assert "starts [0, 5, 8], lengths [5, 3, 2]" in out
    assert "direct construction refused" in out
    assert "missing derived field(s) 'mixed'" in out
    assert "has_mamba_track_mask must be stated explicitly" in out
