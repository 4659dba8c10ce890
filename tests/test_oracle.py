"""The oracle itself, checked against hand-computed cases."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmeta.kernels import SSMParams
from tests.oracle import (
    oracle_conv_row,
    oracle_ssm_row,
    oracle_track_plan,
    split_xbc,
)


def test_conv_by_hand() -> None:
    # K = 2, one channel: out_t = silu(b + w0 * in_{t-1} + w1 * in_t), state = last input
    w = torch.tensor([[2.0, 3.0]])
    b = torch.tensor([0.5])
    xbc = torch.tensor([[1.0], [-1.0]])
    out, windows = oracle_conv_row(xbc, w, b, torch.tensor([[4.0]]))
    expected = F.silu(torch.tensor([0.5 + 2 * 4 + 3 * 1, 0.5 + 2 * 1 + 3 * -1]))
    torch.testing.assert_close(out[:, 0], expected)
    assert [float(s) for s in windows] == [4.0, 1.0, -1.0]


def test_ssm_by_hand() -> None:
    # H = G = P = N = 1, no softplus: h1 = dt x B, h2 = exp(dt A) h1 + dt x B; y = C h + D x
    params = SSMParams(
        A=torch.tensor([-1.0]),
        D=torch.tensor([0.5]),
        dt_bias=torch.tensor([0.0]),
        dt_softplus=False,
    )
    x = torch.tensor([2.0, 3.0]).view(2, 1, 1)
    dt = torch.tensor([0.5, 0.25]).view(2, 1)
    B = torch.tensor([1.0, 2.0]).view(2, 1, 1)
    C = torch.tensor([3.0, -1.0]).view(2, 1, 1)
    y, states = oracle_ssm_row(x, dt, B, C, params, None)
    h1 = 0.5 * 2.0 * 1.0
    h2 = float(torch.exp(torch.tensor(-0.25))) * h1 + 0.25 * 3.0 * 2.0
    torch.testing.assert_close(y.view(-1), torch.tensor([3 * h1 + 1.0, -h2 + 1.5]))
    torch.testing.assert_close(torch.stack(states).view(-1), torch.tensor([0.0, h1, h2]))


def test_split_xbc_layout() -> None:
    u = torch.arange(2 * (2 * 3 + 2 * 1 * 2), dtype=torch.float32).view(2, -1)
    x, B, C = split_xbc(u, nheads=2, headdim=3, ngroups=1, dstate=2)
    assert x.shape == (2, 2, 3)
    assert B.shape == (2, 1, 2)
    assert C.shape == (2, 1, 2)
    assert x[1, 1, 2] == u[1, 5]
    assert B[0, 0, 1] == u[0, 7]
    assert C[1, 0, 0] == u[1, 8]


def test_track_plan_by_hand() -> None:
    # chunk 4, interval 8: row 0 tokens 0..9 prefix 3 -> last boundary abs 8, k = 5,
    # g = 5: off grid. Row 1 tokens 10..15 prefix 2 -> boundary 8 at k = 6 = extend: final.
    plan = oracle_track_plan(
        [10, 6], [3, 2], [True, True], [7, 9], num_decodes=0, chunk_size=4, track_interval=8
    )
    assert [(t.row, t.kind, t.k, t.dst) for t in plan] == [
        (0, "recompute", 5, 7),
        (1, "final", 6, 9),
    ]
