"""The ``hybridmeta demo`` command."""

from __future__ import annotations

import pytest

from hybridmeta.cli import main


def test_demo_shows_the_metadata_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "every ForwardMetadata field carried over unchanged: True" in out
    assert "has_mamba_track_mask=True" in out
    assert "indices [0, 0, 1], offsets [0, 5, 0]" in out
    assert "direct construction refused" in out
    assert "missing derived field(s) 'mixed'" in out
