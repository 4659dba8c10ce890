"""The ``hybridmeta`` command: mode dispatch, ``--help``, no silent fallback, the demo."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest

from hybridmeta import cli
from hybridmeta.cli import main


def test_demo_shows_the_metadata_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "the one carrier: Mamba2Metadata (evolve_from) with has_mamba_track_mask=True" in out
    assert "starts [0, 5, 8], lengths [5, 3, 2]" in out
    assert "direct construction refused" in out
    assert "missing derived field(s) 'mixed'" in out
    assert "has_mamba_track_mask must be stated explicitly" in out


def test_help_lists_every_mode_and_the_default_modes_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    modes = out.split("modes:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in modes] == list(cli.MODES)
    for name, mode in cli.MODES.items():
        assert f"  {name}" in out and mode.summary in out
    assert {"run", "demo"} <= set(cli.MODES)
    # the default mode's options follow, so `make run ARGS=--help` shows them
    for option in ("--model DIR", "--device", "--prompts", "--track-interval", "--quiet"):
        assert option in out


@pytest.mark.parametrize(
    ("argv", "mode", "forwarded"),
    [
        ([], "run", []),
        (["--prompts", "2"], "run", ["--prompts", "2"]),
        (["run", "--prompts", "2"], "run", ["--prompts", "2"]),
        (["demo"], "demo", []),
        (["demo", "--help"], "demo", ["--help"]),
    ],
)
def test_dispatch(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], mode: str, forwarded: list[str]
) -> None:
    calls: list[tuple[str, list[str]]] = []
    for name in cli.MODES:

        def record(args: Sequence[str], name: str = name) -> int:
            calls.append((name, list(args)))
            return 7

        monkeypatch.setitem(cli.MODES, name, cli.Mode(cli.MODES[name].summary, record))
    assert main(argv) == 7
    assert calls == [(mode, forwarded)]


def test_one_more_mode_is_one_entry(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.MODES, "audit", cli.Mode("check a thing", lambda args: len(args)))
    assert main(["audit", "a", "b"]) == 2
    assert main(["--help"]) == 0
    assert "  audit" in capsys.readouterr().out


def test_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bogus"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"hybridmeta: error: unknown mode 'bogus' (modes: {', '.join(cli.MODES)}; "
        "see hybridmeta --help)"
    ]


def test_a_broken_install_fails_loudly_instead_of_running_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes the import raise ImportError, as a broken install would
    monkeypatch.setitem(sys.modules, "hybridmeta.runtime.job", None)
    with pytest.raises(ImportError):
        main(["--prompts", "2"])
    assert "metadata layer" not in capsys.readouterr().out
