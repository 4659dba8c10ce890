"""The ``hybridmeta`` command.

``hybridmeta`` (no arguments) runs the main job: the reference runtime's end-to-end check
(``hybridmeta run --help``). ``hybridmeta demo`` is a short tour of the metadata layer.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence

import torch

from hybridmeta import ForwardMetadata, Mamba2Metadata, fields_of, prepare_decode, prepare_mixed


def _demo() -> int:
    print("hybridmeta: the metadata layer in five steps\n")
    fwd = ForwardMetadata(
        query_start_loc=torch.tensor([0, 5, 10, 11, 12], dtype=torch.int32),
        mamba_cache_indices=torch.tensor([4, 2, 7, 1], dtype=torch.int32),
        mamba_track_indices=torch.tensor([9, -1, -1, 8], dtype=torch.int32),
        mamba_track_mask=torch.tensor([True, False, False, True]),
        has_mamba_track_mask=True,
    )
    print(
        f"1. ForwardMetadata with {len(fields_of(ForwardMetadata))} fields; bs=4, two tracked rows"
    )

    md = prepare_mixed(fwd, extend_seq_lens_cpu=[5, 5], extend_prefix_lens_cpu=[0, 3], chunk_size=8)
    same = all(getattr(md, s.name) is getattr(fwd, s.name) for s in fields_of(ForwardMetadata))
    print(
        f"2. Mamba2Metadata.evolve_from: {md.num_prefills} prefills, {md.num_decodes} decodes; "
        f"every ForwardMetadata field carried over unchanged: {same}; "
        f"has_mamba_track_mask={md.has_mamba_track_mask} (the field sglang PR #26877 dropped)"
    )
    assert md.mixed is not None
    print(
        f"   chunk plan for query_start_loc [0, 5, 10], chunk 8: indices "
        f"{md.mixed.chunk_indices.tolist()}, offsets {md.mixed.chunk_offsets.tolist()}"
    )

    try:
        Mamba2Metadata(query_start_loc=fwd.query_start_loc)  # type: ignore[call-arg]
    except TypeError as e:
        print(f"3. direct construction refused: {e}")
    try:
        Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=4)  # type: ignore[call-arg]
    except TypeError as e:
        print(f"4. a forgotten derived field is an error, not a default: {e}")

    src = inspect.getsource(Mamba2Metadata.evolve_from).splitlines()
    print(f"5. the generated evolve_from is real source ({len(src)} lines), first lines:")
    for line in src[:3]:
        print(f"     {line[:110]}")
    dec = prepare_decode(
        ForwardMetadata(
            query_start_loc=torch.arange(3, dtype=torch.int32),
            mamba_cache_indices=torch.tensor([3, -1], dtype=torch.int32),
        )
    )
    print(f"   decode metadata: num_decodes={dec.num_decodes}, mixed={dec.mixed}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridmeta`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        parser = argparse.ArgumentParser(
            prog="hybridmeta demo", description="Tour of the metadata layer."
        )
        parser.parse_args(args[1:])
        return _demo()
    if args and args[0] == "audit":
        from hybridmeta.audit import main as audit_main

        return audit_main(args[1:])
    if args and args[0] == "run":
        args = args[1:]
    try:
        from hybridmeta.runtime import main_job
    except ImportError:  # the runtime is optional in a minimal install
        return _demo()
    return main_job(args)


if __name__ == "__main__":
    raise SystemExit(main())
