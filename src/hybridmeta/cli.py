"""The ``hybridmeta`` command.

``hybridmeta [run] [options]`` runs the main job: the reference runtime's end-to-end check
(the default mode; ``hybridmeta run --help``). ``hybridmeta demo`` is a short tour of the
metadata layer. ``hybridmeta --help`` lists every mode. A mode is one entry of
:data:`MODES`: a one-line summary and a ``main(argv) -> exit status``. Each mode imports
what it needs when it runs: ``hybridmeta audit`` (a static check) starts without torch.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Sequence

import attrs


def _demo() -> int:
    import torch

    from hybridmeta import (
        ForwardMetadata,
        Mamba2Metadata,
        fields_of,
        plan_mixed_batch,
        prepare_decode,
    )

    print("hybridmeta: the metadata layer in five steps\n")
    md = plan_mixed_batch(
        extend_lens=[5, 5, 1, 1],
        prefix_lens=[0, 3, 7, 15],
        slots=[4, 2, 7, 1],
        num_decodes=2,
        chunk_size=8,
        conv_kernel=4,
        track_interval=8,
        track_mask=[True, False, False, True],
        track_slots=[9, -1, -1, 8],
    )
    print(
        f"1. plan_mixed_batch: {md.num_prefills} prefill rows, {md.num_decodes} decode rows, "
        f"one staged copy; ForwardMetadata has {len(fields_of(ForwardMetadata))} fields"
    )
    print(
        f"2. the one carrier: Mamba2Metadata (evolve_from) with has_mamba_track_mask="
        f"{md.has_mamba_track_mask} (row 3 reaches token 16: saved after the layers); "
        "every Mamba2 op reads it"
    )
    assert md.mixed is not None
    print(
        f"   chunk plan for rows of 5 and 5 tokens, chunk 8: starts "
        f"{md.mixed.chunks.start.tolist()}, lengths {md.mixed.chunks.length.tolist()}"
    )
    try:
        Mamba2Metadata(query_start_loc=md.query_start_loc)  # type: ignore[call-arg]
    except TypeError as e:
        print(f"3. direct construction refused: {e}")
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(3, dtype=torch.int32),
        mamba_cache_indices=torch.tensor([3, 5], dtype=torch.int32),
    )
    try:
        Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2)  # type: ignore[call-arg]
    except TypeError as e:
        print(f"4. a forgotten derived field is an error, not a default: {e}")
    try:
        ForwardMetadata(
            query_start_loc=torch.arange(3),
            mamba_cache_indices=torch.tensor([3, 5]),
            mamba_track_indices=torch.tensor([9, -1]),
            mamba_track_mask=torch.tensor([True, False]),
        )
    except ValueError as e:
        print(f"   and so is a behaviour flag left to its default beside its data: {e}")
    src = inspect.getsource(Mamba2Metadata.evolve_from).splitlines()
    print(f"5. the generated evolve_from is real source ({len(src)} lines), first lines:")
    for line in src[:3]:
        print(f"     {line[:110]}")
    dec = prepare_decode(fwd)
    print(f"   decode metadata: num_decodes={dec.num_decodes}, mixed={dec.mixed}")
    return 0


def _demo_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridmeta demo", description=MODES["demo"].summary)
    parser.parse_args(list(argv))
    return _demo()


def _run_main(argv: Sequence[str]) -> int:
    # No fallback: a runtime that fails to import is a broken install and must say so.
    from hybridmeta.runtime.job import main_job

    return main_job(list(argv))


def _audit_main(argv: Sequence[str]) -> int:
    from hybridmeta.audit import main as audit_main

    return audit_main(list(argv))


@attrs.frozen
class Mode:
    """One mode of the ``hybridmeta`` command."""

    summary: str
    main: Callable[[Sequence[str]], int]


#: The command's modes, in the order ``--help`` lists them; the first is the default.
MODES: dict[str, Mode] = {
    "run": Mode(
        "the main job: a mixed workload through the reference runtime, checked end to end "
        "(default)",
        _run_main,
    ),
    "demo": Mode("a short tour of the metadata layer", _demo_main),
    "audit": Mode(
        "find metadata constructors that drop source fields (static check of Python files)",
        _audit_main,
    ),
}
DEFAULT_MODE = "run"


def _usage() -> str:
    width = max(len(name) for name in MODES)
    lines = [
        "usage: hybridmeta [MODE] [options]",
        "",
        "modes:",
        *(f"  {name:<{width}}  {mode.summary}" for name, mode in MODES.items()),
        "",
        "'hybridmeta MODE --help' shows the options of one mode. Without a mode, the "
        f"options go to '{DEFAULT_MODE}'.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridmeta`` command; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(_usage() + "\n", flush=True)
        return MODES[DEFAULT_MODE].main(["--help"])
    if args and args[0] in MODES:
        return MODES[args[0]].main(args[1:])
    if args and not args[0].startswith("-"):
        print(
            f"hybridmeta: error: unknown mode {args[0]!r} (modes: {', '.join(MODES)}; "
            "see hybridmeta --help)",
            file=sys.stderr,
        )
        return 2
    return MODES[DEFAULT_MODE].main(args)


if __name__ == "__main__":
    raise SystemExit(main())
