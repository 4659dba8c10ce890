"""Hypothesis strategies for the reference runtime (workload shapes and runtime sizes)."""

from __future__ import annotations

from hypothesis import strategies as st

from hybridmeta.runtime.engine import RuntimeOptions

__all__ = ["runtime_options", "token_lists"]


@st.composite
def runtime_options(draw: st.DrawFn, *, chunk_size: int = 8, max_len: int = 80) -> RuntimeOptions:
    """Small runtimes: 1-3 working slots (slot pressure), 1-4 track slots (evictions),
    track intervals of 1-2 chunks, prefill budgets of 1-3 intervals, graphs on or off,
    decode overlap on or off
    (the Mamba2 ops run their references on the CPU; the Triton kernels are left to the
    example tests: the interpreter is too slow for many examples)."""
    interval = chunk_size * draw(st.integers(1, 2))
    working = draw(st.integers(1, 3))
    return RuntimeOptions(
        num_working=working,
        num_track=draw(st.integers(1, 4)),
        max_len=max_len,
        track_interval=interval,
        max_prefill_tokens=interval * draw(st.integers(1, 3)),
        use_graphs=draw(st.booleans()),
        max_decode_bs=working,
        overlap_decode=draw(st.booleans()),
    )


def token_lists(
    vocab: int, *, min_size: int = 1, max_size: int = 30
) -> st.SearchStrategy[list[int]]:
    """Token id lists (a small alphabet part of the time, so prefixes repeat by chance)."""
    return st.one_of(
        st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_size),
        st.lists(st.integers(0, 2), min_size=min_size, max_size=max_size),
    )
