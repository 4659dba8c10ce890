"""GPU-only tests of the speculative-decoding kernels at Nemotron-Nano-9B-v2 shapes.

Verify (chains, trees, ragged draft counts, pad rows) and commit against their references,
a chain against sequential single-token updates, and the compiled-variant count across
batch sizes and draft lengths.
"""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels import (
    causal_conv1d_update,
    conv_verify_update,
    spec_commit,
    spec_track_token,
    ssm_state_update,
    ssm_verify_update,
)
from hybridmeta.kernels._config import SsmLaunchConfig
from hybridmeta.kernels.conv_verify import _conv_verify_kernel
from hybridmeta.kernels.spec_commit import _spec_commit_kernel
from hybridmeta.kernels.ssm_verify import _ssm_verify_kernel, launch_ssm_verify
from tests.kernels._support import (
    assert_close,
    bits,
    compiled_count,
    conv_verify_update_ref,
    spec_commit_ref,
    ssm_verify_update_ref,
)

pytestmark = pytest.mark.gpu

# Nemotron-Nano-9B-v2 Mamba layer (tensor parallel 1).
H, P, N, G, CONV_DIM, K = 128, 80, 128, 8, 12288, 4
CUDA = torch.device("cuda")
ACT = torch.bfloat16
# Six rows of four draft tokens: a tree, a pad row (garbage tree), a chain, a forest,
# a pad row, a two-branch tree.
SRC = [5, -1, 17, 2, -1, 9]
PARENTS = [[-1, 0, 0, 1], [7, 3, -9, 2], [-1, 0, 1, 2], [-1, -1, 0, 1], [0, 0, 0, 0], [-1, 0, 1, 0]]


def _inputs(bs: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(CUDA)

    return {
        "x": rnd(bs, T, H, P).to(ACT),
        "dt": rnd(bs, T, H, scale=0.5).to(ACT),
        "A": -torch.rand(H, generator=g).to(CUDA) * 2.0,
        "B": rnd(bs, T, G, N).to(ACT),
        "C": rnd(bs, T, G, N).to(ACT),
        "D": rnd(H),
        "z": rnd(bs, T, H, P).to(ACT),
        "dt_bias": rnd(H, scale=0.5),
        "xc": rnd(bs, T, CONV_DIM).to(ACT),
        "w": (rnd(CONV_DIM, K) * 0.5).to(ACT),
        "cb": rnd(CONV_DIM).to(ACT),
    }


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["chain", "tree", "ragged tree"])
def test_verify_nano_shapes_match_reference(state_dtype: torch.dtype, mode: str) -> None:
    slots, bs, T = 24, len(SRC), 4
    a = _inputs(bs, T, 0)
    src = torch.tensor(SRC, device=CUDA)
    parent = torch.tensor(PARENTS, device=CUDA) if mode != "chain" else None
    nd = torch.tensor([3, 9, 4, 1, 0, 2], device=CUDA) if mode == "ragged tree" else None
    state = torch.randn(slots, H, P, N, device=CUDA).to(state_dtype)
    cs = torch.randn(slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    state0, cs0 = state.clone(), cs.clone()
    # Static buffers one row and one column larger; the kernels get the [:bs, :T] corner.
    inter = torch.full((bs + 1, T + 1, H, P, N), float("nan"), device=CUDA).to(state_dtype)
    out = torch.full((bs + 1, T + 1, H, P), float("nan"), device=CUDA).to(ACT)
    ic = torch.full((bs + 1, T + 1, CONV_DIM, K - 1), float("nan"), device=CUDA).to(cs.dtype)
    oc = torch.full((bs + 1, T + 1, CONV_DIM), float("nan"), device=CUDA).to(ACT)
    ssm_verify_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, inter=inter[:bs, :T],
        D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, parent=parent, num_draft=nd,
        out=out[:bs, :T],
    )  # fmt: skip
    conv_verify_update(
        a["xc"], cs, a["w"], a["cb"], cache_indices=src, inter=ic[:bs, :T], parent=parent,
        num_draft=nd, out=oc[:bs, :T],
    )  # fmt: skip
    ref_inter, ref_out = ssm_verify_update_ref(
        state0, a["x"], a["dt"], a["A"], a["B"], a["C"], inter[:bs, :T].clone(), src, D=a["D"],
        z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, parent=parent, num_draft=nd,
    )  # fmt: skip
    ref_ic, ref_oc = conv_verify_update_ref(
        a["xc"], cs0, a["w"], a["cb"], ic[:bs, :T].clone(), src, silu=True, parent=parent,
        num_draft=nd,
    )  # fmt: skip
    n = torch.tensor([3, 0, 4, 1, 0, 2] if mode == "ragged tree" else [T, 0, T, T, 0, T])
    keep = (torch.arange(T)[None, :] < n[:, None]).to(CUDA)
    assert_close(out[:bs, :T], ref_out, "ssm out")
    assert_close(inter[:bs, :T][keep], ref_inter[keep], "ssm inter")
    assert_close(oc[:bs, :T], ref_oc, "conv out")
    # On the GPU every cast rounds to nearest like torch: the windows are bit-exact.
    assert torch.equal(bits(ic[:bs, :T][keep]), bits(ref_ic[keep]))
    for name, buf in (("inter", inter), ("inter_conv", ic)):
        assert bool(torch.isnan(buf[:bs, :T][~keep].float()).all()), f"{name}: dead block"
        assert bool(torch.isnan(buf[bs:].float()).all()), f"{name}: row past bs"
        assert bool(torch.isnan(buf[:, T:].float()).all()), f"{name}: column past T"
    assert bool((out[:bs, :T][~keep] == 0).all())
    assert bool((oc[:bs, :T][~keep] == 0).all())
    assert torch.equal(bits(state), bits(state0)), "the SSM pool is only read"
    assert torch.equal(bits(cs), bits(cs0)), "the conv pool is only read"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_chain_equals_sequential_updates_and_commit(state_dtype: torch.dtype) -> None:
    """Verify a chain, accept k tokens per row, commit over 2 layers with a track boundary:
    the working slots equal k sequential single-token updates, the track slot the state
    at the boundary token."""
    slots, bs, T, L = 16, 4, 4, 2
    a = _inputs(bs, T, 1)
    src = torch.tensor([3, -1, 11, 6], device=CUDA)
    pool = torch.randn(L, slots, H, P, N, device=CUDA).to(state_dtype)
    cpool = torch.randn(L, slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    inter = torch.empty(L, bs, T, H, P, N, device=CUDA, dtype=state_dtype)
    ic = torch.empty(L, bs, T, CONV_DIM, K - 1, device=CUDA, dtype=torch.bfloat16)
    for layer in range(L):
        ssm_verify_update(
            pool[layer], a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src,
            inter=inter[layer], D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True,
        )  # fmt: skip
        conv_verify_update(a["xc"], cpool[layer], a["w"], a["cb"], cache_indices=src,
                           inter=ic[layer])  # fmt: skip
    k = torch.tensor([2, 3, 4, 0], device=CUDA)
    seq_lens = torch.tensor([255, 0, 1020, 7], device=CUDA)
    track_token = spec_track_token(seq_lens, k, 256)
    assert track_token.tolist() == [0, -1, 3, -1]
    track = torch.tensor([12, 13, 14, 15], device=CUDA)
    mask = torch.tensor([True, True, True, True], device=CUDA)

    # Sequential single-token updates of layer 0, on a copy.
    seq, seq_c = pool[0].clone(), cpool[0].clone()
    after: list[torch.Tensor] = []
    for t in range(T):
        live = torch.where(k > t, src, -1)
        ssm_state_update(
            seq, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t],
            state_indices=live, D=a["D"], z=a["z"][:, t], dt_bias=a["dt_bias"], dt_softplus=True,
        )  # fmt: skip
        causal_conv1d_update(a["xc"][:, t], seq_c, a["w"], a["cb"], cache_indices=live)
        after.append(seq.clone())

    before, cbefore = pool.clone(), cpool.clone()
    ref_c, ref_s = spec_commit_ref(
        cbefore, before, ic, inter, src, k - 1, track, mask, track_token
    )
    spec_commit(
        cpool, pool, ic, inter, state_indices=src, accepted_index=k - 1, track_indices=track,
        track_mask=mask, track_token=track_token,
    )  # fmt: skip
    assert torch.equal(bits(pool), bits(ref_s))
    assert torch.equal(bits(cpool), bits(ref_c))
    for b, slot in ((0, 3), (2, 11)):
        assert_close(pool[0, slot], seq[slot], f"working slot of row {b}")
        assert torch.equal(bits(cpool[0, slot]), bits(seq_c[slot]))
    # Row 0 crossed 256 at its first token; row 2 crossed 1024 at its fourth.
    assert_close(pool[0, 12], after[0][3], "track slot of row 0")
    assert_close(pool[0, 14], after[3][11], "track slot of row 2")
    untouched = [s for s in range(slots) if s not in (3, 11, 12, 14)]
    assert torch.equal(bits(pool[:, untouched]), bits(before[:, untouched]))
    assert torch.equal(bits(cpool[:, untouched]), bits(cbefore[:, untouched]))


def test_commit_27_layers_matches_reference() -> None:
    layers, slots, bs, T = 27, 10, 4, 3
    ssm = torch.randn(layers, slots, H, P, N, device=CUDA)
    conv = torch.randn(layers, slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    iss = torch.randn(layers, bs, T, H, P, N, device=CUDA)
    ic = torch.randn(layers, bs, T, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    src = torch.tensor([4, -1, 0, 7], device=CUDA)
    acc = torch.tensor([2, 1, 0, -1], device=CUDA)
    trk = torch.tensor([9, 1, 2, 3], device=CUDA)
    mask = torch.tensor([True, True, False, True], device=CUDA)
    tok = torch.tensor([1, 0, 0, 2], device=CUDA)
    ref_c, ref_s = spec_commit_ref(conv, ssm, ic, iss, src, acc, trk, mask, tok)
    spec_commit(conv, ssm, ic, iss, state_indices=src, accepted_index=acc, track_indices=trk,
                track_mask=mask, track_token=tok)  # fmt: skip
    assert torch.equal(bits(ssm), bits(ref_s))
    assert torch.equal(bits(conv), bits(ref_c))


def test_new_batch_size_or_draft_length_never_recompiles() -> None:
    slots = 80
    state = torch.randn(slots, H, P, N, device=CUDA)
    cs = torch.randn(slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    pool = torch.randn(1, slots, H, P, N, device=CUDA)
    cpool = torch.randn(1, slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    counts: list[tuple[int, int, int]] = []
    for i, (bs, T) in enumerate(((1, 2), (2, 4), (3, 1), (7, 3), (16, 8), (33, 2), (5, 16))):
        a = _inputs(bs, T, i)
        perm = torch.randperm(slots, device=CUDA)
        # Fresh (16-byte aligned) tensors, as static buffers are: alignment is a
        # specialisation of its own; batch size and draft length must not be.
        src, trk = perm[:bs].clone(), perm[bs : 2 * bs].clone()
        parent = (torch.arange(T, device=CUDA) - 1).repeat(bs, 1).contiguous()
        inter = torch.empty(bs, T, H, P, N, device=CUDA)
        ic = torch.empty(bs, T, CONV_DIM, K - 1, device=CUDA, dtype=torch.bfloat16)
        ssm_verify_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, inter=inter,
            D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, parent=parent,
        )  # fmt: skip
        conv_verify_update(a["xc"], cs, a["w"], a["cb"], cache_indices=src, inter=ic,
                           parent=parent)  # fmt: skip
        acc = torch.randint(-1, T, (bs,), device=CUDA)
        spec_commit(
            cpool, pool, ic[None], inter[None], state_indices=src, accepted_index=acc,
            track_indices=trk, track_mask=torch.rand(bs, device=CUDA) < 0.5,
            track_token=torch.randint(-1, T, (bs,), device=CUDA),
        )  # fmt: skip
        torch.cuda.synchronize()
        counts.append(
            (
                compiled_count(_ssm_verify_kernel),
                compiled_count(_conv_verify_kernel),
                compiled_count(_spec_commit_kernel),
            )
        )
    assert all(c == counts[0] for c in counts), f"compiled variants per (bs, T): {counts}"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_p", "num_warps"), [(4, 1), (8, 1), (16, 1), (8, 2), (16, 2)])
def test_verify_tile_shapes_match_reference(
    state_dtype: torch.dtype, block_p: int, num_warps: int
) -> None:
    """Every candidate tile of the verify kernel is right at Nano shapes (a tree)."""
    slots, bs, T = 24, len(SRC), 4
    a = _inputs(bs, T, 5)
    src = torch.tensor(SRC, device=CUDA)
    parent = torch.tensor(PARENTS, device=CUDA)
    state = torch.randn(slots, H, P, N, device=CUDA).to(state_dtype)
    inter = torch.full((bs, T, H, P, N), float("nan"), device=CUDA).to(state_dtype)
    out = torch.full((bs, T, H, P), float("nan"), device=CUDA).to(ACT)
    launch_ssm_verify(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], out, inter, src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, parent=parent, num_draft=None,
        config=SsmLaunchConfig(block_p=block_p, num_warps=num_warps),
    )  # fmt: skip
    ref_inter, ref_out = ssm_verify_update_ref(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], inter.clone(), src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, parent=parent,
    )  # fmt: skip
    live = src >= 0
    assert_close(out, ref_out, "out")
    assert_close(inter[live], ref_inter[live], "inter")
    assert bool(torch.isnan(inter[~live].float()).all())
