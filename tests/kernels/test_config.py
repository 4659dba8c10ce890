"""Launch-configuration helpers: plain-int stand-ins for Triton's host helpers."""

from __future__ import annotations

import triton

from hybridmeta.kernels._config import cdiv, pow2_ceil


def test_pow2_ceil_agrees_with_triton() -> None:
    for n in range(1, 70_000):
        assert pow2_ceil(n) == triton.next_power_of_2(n), n
    assert pow2_ceil(0) == 1  # a block is never empty (Triton answers 0)


def test_cdiv_agrees_with_triton() -> None:
    for a in range(0, 600):
        for b in (1, 2, 3, 7, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
