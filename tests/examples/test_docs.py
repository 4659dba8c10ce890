"""The falsifying outputs quoted in docs/testing.md are what the tools print today."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import settings

from examples.legacy_engine.harness import stale_tail_backend
from examples.legacy_engine.metadata import ForwardMetadata, prepare_decode_dropping
from hybridmeta.audit import main as audit_main
from hybridmeta.testing import FieldFlowError, ReplayFailure, assert_field_flow, check_replay

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"
_QUOTE = re.compile(r"<!-- quoted: (\S+) -->\n```text\n(.*?)```", re.S)


def _quoted() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _QUOTE.finditer(DOC.read_text())}


def _norm(text: str) -> str:
    """Values that may vary between runs and versions: floats, Hypothesis's blob line."""
    text = re.sub(r"-?\d+\.\d+(e[-+]?\d+)?", "<float>", text)
    lines = [ln.rstrip() for ln in text.strip().splitlines() if "@reproduce_failure" not in ln]
    return "\n".join(lines)


def _repro() -> settings:
    return settings.get_profile("hybridmeta-repro")


def test_the_doc_quotes_every_output() -> None:
    assert set(_quoted()) == {"dropped-field", "stale-tail", "audit-examples"}


def test_quoted_stale_tail_failure() -> None:
    with pytest.raises(ReplayFailure) as info:
        check_replay(stale_tail_backend, settings=_repro())
    assert _norm(str(info.value)) == _norm(_quoted()["stale-tail"])


def test_quoted_dropped_field_failure() -> None:
    with pytest.raises(FieldFlowError) as info:
        assert_field_flow(ForwardMetadata, prepare_decode_dropping, settings=_repro())
    assert _norm(str(info.value)) == _norm(_quoted()["dropped-field"])


def test_quoted_audit_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    assert audit_main(["examples"]) == 1
    assert _norm(capsys.readouterr().out) == _norm(_quoted()["audit-examples"])
