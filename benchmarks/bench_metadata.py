"""Benchmark: ``Mamba2Metadata.evolve_from`` against an equivalent hand-written constructor.

The hand-written baseline is what engines write today: an attrs frozen slotted class with
the same fields, built by re-listing every field by keyword, running the same validation.
Target: evolve_from within 1.2x of it. Writes JSON (``--out DIR``).

    python benchmarks/bench_metadata.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

import attrs
import torch

import hybridmeta
from hybridmeta import ForwardMetadata, Mamba2Metadata, fields_of


def _handwritten_class(*, validate: bool) -> type:
    """An attrs class with Mamba2Metadata's fields, built the engine way (every field by
    keyword). With ``validate`` it runs the same checks the generated path runs."""
    names = [s.name for s in fields_of(Mamba2Metadata)]
    ns: dict[str, Any] = {n: attrs.field() for n in names}
    ns["__annotations__"] = dict.fromkeys(names, "Any")
    if validate:
        ns["__validate__"] = Mamba2Metadata.__validate__
        ns["__attrs_post_init__"] = Mamba2Metadata.__hm_validate__  # type: ignore[attr-defined]
    cls = type("HandWrittenMamba2Metadata", (), ns)
    return attrs.define(cls, frozen=True, slots=True, kw_only=True, eq=False)


def _fwd(bs: int, device: str) -> ForwardMetadata:
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=device),
        mamba_cache_indices=torch.arange(bs, dtype=torch.int32, device=device),
        mamba_track_indices=torch.arange(bs, 2 * bs, dtype=torch.int32, device=device),
        mamba_track_mask=torch.zeros(bs, dtype=torch.bool, device=device),
        has_mamba_track_mask=True,
    )


def _time(fn: Any, number: int, repeat: int) -> float:
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args(argv)

    hand_checked = _handwritten_class(validate=True)
    hand_plain = _handwritten_class(validate=False)
    fwd = _fwd(64, args.device)
    n = fwd.mamba_cache_indices.shape[0]

    def generated() -> object:
        return Mamba2Metadata.evolve_from(
            fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=n, mixed=None
        )

    def handwritten(hand: Any = hand_checked) -> object:
        return hand(
            query_start_loc=fwd.query_start_loc,
            mamba_cache_indices=fwd.mamba_cache_indices,
            mamba_track_indices=fwd.mamba_track_indices,
            mamba_track_mask=fwd.mamba_track_mask,
            retrieve_next_token=fwd.retrieve_next_token,
            retrieve_next_sibling=fwd.retrieve_next_sibling,
            retrieve_parent_token=fwd.retrieve_parent_token,
            track_conv_indices=fwd.track_conv_indices,
            track_ssm_h_src=fwd.track_ssm_h_src,
            track_ssm_h_dst=fwd.track_ssm_h_dst,
            track_ssm_final_src=fwd.track_ssm_final_src,
            track_ssm_final_dst=fwd.track_ssm_final_dst,
            is_target_verify=fwd.is_target_verify,
            draft_token_num=fwd.draft_token_num,
            has_mamba_track_mask=fwd.has_mamba_track_mask,
            mamba_track_mask_indices=fwd.mamba_track_mask_indices,
            conv_states_mask_indices=fwd.conv_states_mask_indices,
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=n,
            mixed=None,
        )

    # Sanity: both build the same thing.
    a, b = generated(), handwritten()
    assert all(getattr(a, s.name) is getattr(b, s.name) for s in fields_of(Mamba2Metadata))

    # Interleave the two to spread machine noise evenly.
    gen_t: list[float] = []
    hand_t: list[float] = []
    plain_t: list[float] = []
    for _ in range(args.repeat):
        gen_t.append(_time(generated, args.number, 1))
        hand_t.append(_time(handwritten, args.number, 1))
        plain_t.append(_time(lambda: handwritten(hand_plain), args.number, 1))
    g, h = statistics.median(gen_t), statistics.median(hand_t)
    u = statistics.median(plain_t)
    result = {
        "benchmark": "evolve_from vs hand-written constructor",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hybridmeta": hybridmeta.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "device": args.device,
        "fields": len(fields_of(Mamba2Metadata)),
        "evolve_from_us": round(g, 3),
        "handwritten_us": round(h, 3),
        "ratio": round(g / h, 3),
        "handwritten_unvalidated_us": round(u, 3),
        "ratio_vs_unvalidated": round(g / u, 3),
        "target_ratio": 1.2,
        "samples_us": {"evolve_from": gen_t, "handwritten": hand_t, "unvalidated": plain_t},
    }
    print(
        f"evolve_from {g:.2f} us | hand-written constructor, same checks {h:.2f} us "
        f"(ratio {g / h:.3f}) | hand-written, no checks {u:.2f} us (ratio {g / u:.3f}) | "
        f"target <= 1.2 | {len(fields_of(Mamba2Metadata))} fields, device {args.device}"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "metadata_evolve_from.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
