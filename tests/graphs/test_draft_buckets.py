"""Static buffers and the runner bucketed over ``(B, T)``: verify rows with draft columns.

Fields that declare columns (``retrieve_*``) are ``[max_bs, max_draft]`` buffers handed out as
``[:B, :T]`` views; per-token inputs have ``B * T`` rows; the commit's derived metadata
class is buffered from its own declarations; the runner captures every ``(B, T)`` and
replays the smallest one that fits.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from hybridmeta import TOKENS, ForwardMetadata, debug_mode
from hybridmeta.graphs import EmulatedGraphBackend, GraphRunner, InputSpec, StaticBuffers
from hybridmeta.model import Mamba2Metadata, SpecCommitMetadata, prepare_target_verify

MAX_BS, MAX_DRAFT, SLOTS = 4, 3, 10


def _verify_buffers(**kw: object) -> StaticBuffers:
    args: dict[str, object] = {
        "max_bs": MAX_BS,
        "num_slots": SLOTS,
        "device": "cpu",
        "max_draft": MAX_DRAFT,
        "static": {"is_target_verify": True},
        "optional_fields": ("retrieve_parent_token",),
        "inputs": {"h": InputSpec((2,), torch.float32, rows=TOKENS, pad=0.5)},
    }
    args.update(kw)
    return StaticBuffers(**args)  # type: ignore[arg-type]


def _step(slots: list[int], t: int, parent: list[list[int]] | None = None) -> ForwardMetadata:
    bs = len(slots)
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1) * t,
        mamba_cache_indices=torch.tensor(slots),
        is_target_verify=True,
        draft_token_num=t,
        retrieve_parent_token=torch.tensor(parent) if parent is not None else None,
    )


def _junk(buffers: StaticBuffers) -> None:
    def fill(name: str, tail: torch.Tensor) -> None:
        tail.fill_(float("nan") if tail.is_floating_point() else 7)

    buffers.poison_(0, fill)


def test_exact_bucket_hands_out_B_rows_T_columns_and_B_times_T_tokens() -> None:
    buffers = _verify_buffers()
    _junk(buffers)
    step = _step([3, 5], 2, [[-1, 0], [-1, -1]])
    h = torch.arange(8, dtype=torch.float32).view(4, 2)
    md = buffers.refresh(step, (3, 2), {"h": h})
    assert md.draft_token_num == 2 and md.num_decodes == 3
    assert md.mamba_cache_indices.tolist() == [3, 5, -1]
    assert md.retrieve_parent_token is not None
    # [:B, :T] of a [max_bs, max_draft] buffer: the stale third column is not in the view.
    assert md.retrieve_parent_token.tolist() == [[-1, 0], [-1, -1], [-1, -1]]
    assert md.query_start_loc.tolist() == [0, 2, 4, 4]
    v = buffers.views((3, 2))["h"]
    assert v.shape == (6, 2)
    assert v[:4].equal(h) and (v[4:] == 0.5).all()


def test_narrower_step_pads_its_draft_columns_from_the_declarations() -> None:
    buffers = _verify_buffers()
    _junk(buffers)
    step = _step([3, 5], 2, [[-1, 0], [-1, -1]])
    h = torch.arange(8, dtype=torch.float32).view(4, 2)
    md = buffers.refresh(step, (3, 3), {"h": h})
    assert md.draft_token_num == 3
    assert md.retrieve_parent_token is not None
    assert md.retrieve_parent_token.tolist() == [[-1, 0, -1], [-1, -1, -1], [-1, -1, -1]]
    # Offsets of the bucket's layout: every live row has T tokens, pad rows none.
    assert md.query_start_loc.tolist() == [0, 3, 6, 6]
    grid = buffers.views((3, 3))["h"].view(3, 3, 2)
    assert grid[:2, :2].equal(h.view(2, 2, 2))
    assert (grid[:2, 2] == 0.5).all() and (grid[2] == 0.5).all()


def test_a_tree_buffer_needs_a_tree_in_every_step() -> None:
    # The pad of retrieve_parent_token (-1, a root) cannot stand for None (a chain).
    buffers = _verify_buffers()
    h = torch.zeros(2, 2)
    with pytest.raises(
        ValueError,
        match=r"retrieve_parent_token is None but the graphs were captured reading it; its pad cannot "
        r"stand for None \(build buffers without it, optional_fields, for steps that "
        r"omit it\)$",
    ):
        buffers.refresh(_step([1], 2), (1, 2), {"h": h})
    chains = _verify_buffers(optional_fields=())
    md = chains.refresh(_step([1], 2), (1, 2), {"h": h})
    assert md.retrieve_parent_token is None
    with pytest.raises(ValueError, match="retrieve_parent_token is set but is not a static buffer"):
        chains.refresh(_step([1], 2, [[-1, 0]]), (1, 2), {"h": h})


@pytest.mark.parametrize(
    ("bucket", "t", "match"),
    [((2, 1), 2, r"^StaticBuffers\.refresh: bucket draft columns must satisfy draft_token_num <= T "
                 r"<= max_draft \(2 <= 1 <= 3\)$"),
     ((2, 4), 2, r"\(2 <= 4 <= 3\)")],
)  # fmt: skip
def test_draft_bucket_out_of_range_is_refused(bucket: tuple[int, int], t: int, match: str) -> None:
    buffers = _verify_buffers(optional_fields=())
    with pytest.raises(ValueError, match=match):
        buffers.refresh(_step([1], t), bucket, {"h": torch.zeros(t, 2)})


def test_per_token_input_rows_follow_the_step_draft_length() -> None:
    buffers = _verify_buffers(optional_fields=())
    with pytest.raises(ValueError, match=r"input h must have 4 rows \(bs=2 x t=2\), got 3"):
        buffers.refresh(_step([1, 2], 2), (2, 2), {"h": torch.zeros(3, 2)})


def test_commit_buffers_are_declared_by_the_derived_class() -> None:
    buffers = StaticBuffers(
        max_bs=MAX_BS, num_slots=SLOTS, device="cpu", max_draft=MAX_DRAFT,
        metadata_class=SpecCommitMetadata, static={"is_target_verify": True},
    )  # fmt: skip
    assert {"accepted_index", "track_token"} <= set(buffers.field_names)
    _junk(buffers)
    md = prepare_target_verify(_step([2, 6], 2))
    cmd = SpecCommitMetadata.evolve_from(
        md, accepted_index=torch.tensor([1, 0]), track_token=torch.tensor([0, -1])
    )
    out = buffers.refresh(cmd, (3, 2))
    assert type(out) is SpecCommitMetadata
    assert out.accepted_index.tolist() == [1, 0, -1]
    assert out.track_token.tolist() == [0, -1, -1]
    assert out.mamba_cache_indices.tolist() == [2, 6, -1]
    with pytest.raises(TypeError, match="step must be a SpecCommitMetadata, got ForwardMetadata"):
        buffers.refresh(_step([2, 6], 2), (3, 2))


def test_metadata_class_must_be_mamba2_metadata_or_derived_from_it() -> None:
    with pytest.raises(
        ValueError, match="metadata_class must be Mamba2Metadata or a class derived"
    ):
        StaticBuffers(max_bs=2, num_slots=4, device="cpu", metadata_class=ForwardMetadata)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- the runner


def _runner(draft_buckets: tuple[int, ...] | None = None) -> GraphRunner:
    buffers = _verify_buffers()

    def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Per token: h + the row's slot + 10 * the token's parent; per row: T * slot.
        assert md.retrieve_parent_token is not None
        slots = md.mamba_cache_indices.repeat_interleave(md.draft_token_num)
        par = md.retrieve_parent_token.reshape(-1)
        tok = ins["h"] + (slots + 10 * par)[:, None]
        return {"tok": tok, "row": md.mamba_cache_indices * md.draft_token_num}

    runner = GraphRunner(
        step, buffers, buckets=(2, MAX_BS), draft_buckets=draft_buckets,
        backend=EmulatedGraphBackend("cpu"),
    )  # fmt: skip
    runner.capture()
    return runner


def test_runner_captures_every_bucket_pair_and_replays_the_smallest_that_fits() -> None:
    runner = _runner()
    assert runner.draft_buckets == (1, 2, 3)  # default: every T exact
    assert runner.captured
    assert [runner.draft_bucket_for(t) for t in (1, 2, 3)] == [1, 2, 3]
    h = torch.zeros(6, 2)
    out = runner.run(_step([3, 4, 5], 2, [[-1, 0], [-1, -1], [-1, 0]]), {"h": h})
    assert out["row"].tolist() == [6, 8, 10]  # bucket (4, 2): T = 2 exactly
    assert out["tok"][:, 0].tolist() == [-7.0, 3.0, -6.0, -6.0, -5.0, 5.0]
    with pytest.raises(
        ValueError, match="draft_token_num=4 exceeds the largest captured draft bucket 3"
    ):
        runner.run(_step([1], 4, [[-1, 0, 1, 2]]), {"h": torch.zeros(4, 2)})


def test_runner_with_sparse_draft_buckets_pads_columns_and_returns_live_tokens() -> None:
    runner = _runner(draft_buckets=(1, 3))
    assert runner.draft_bucket_for(2) == 3
    h = torch.arange(4, dtype=torch.float32)[:, None].expand(4, 2).contiguous()
    out = runner.run(_step([3, 4], 2, [[-1, 0], [-1, -1]]), {"h": h})
    assert out["row"].tolist() == [9, 12]  # replayed at T = 3
    # The live [bs, t] tokens only, padded column dropped.
    assert out["tok"][:, 0].tolist() == [-7.0, 4.0, -4.0, -3.0]


@pytest.mark.parametrize("draft_buckets", [(), (0, 3), (1, 2)])
def test_draft_buckets_must_end_at_max_draft(draft_buckets: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="draft_buckets must be >= 1 and end at max_draft=3"):
        GraphRunner(lambda md, ins: {}, _verify_buffers(), draft_buckets=draft_buckets)


@pytest.mark.parametrize(
    ("accepted", "token", "match"),
    [
        # the count passed for the index: the captured commit silently skipped the row
        ([2, 0], [-1, -1], r"accepted_index row 0 holds 2: must be -1 \(none\) or a draft "
         r"column in \[0, draft_token_num=2\)"),
        ([0, -2], [-1, -1], r"accepted_index row 1 holds -2"),
        ([0, 1], [-1, 5], r"track_token row 1 holds 5"),  # row 1 is flagged
    ],
)  # fmt: skip
def test_commit_columns_outside_the_draft_are_refused_in_debug_mode_before_writing(
    accepted: list[int], token: list[int], match: str
) -> None:
    buffers = StaticBuffers(
        max_bs=MAX_BS, num_slots=SLOTS, device="cpu", max_draft=MAX_DRAFT,
        metadata_class=SpecCommitMetadata, static={"is_target_verify": True},
    )  # fmt: skip
    _junk(buffers)
    verify = prepare_target_verify(
        ForwardMetadata(
            query_start_loc=torch.tensor([0, 2, 4]),
            mamba_cache_indices=torch.tensor([2, 6]),
            mamba_track_indices=torch.tensor([-1, 8]),
            mamba_track_mask=torch.tensor([False, True]),
            has_mamba_track_mask=True,
            is_target_verify=True,
            draft_token_num=2,
        )
    )
    cmd = SpecCommitMetadata.evolve_from(
        verify, accepted_index=torch.tensor(accepted), track_token=torch.tensor(token)
    )
    before = buffers.snapshot()
    refusal = r"StaticBuffers\.refresh: SpecCommitMetadata\." + match
    with debug_mode(), pytest.raises(ValueError, match=refusal):
        buffers.refresh(cmd, (3, 2))
    after = buffers.snapshot()
    for name, t in before.items():
        assert torch.equal(after[name], t), name
    # An unflagged row's track_token is never read: any value passes.
    ok = SpecCommitMetadata.evolve_from(
        verify, accepted_index=torch.tensor([1, 0]), track_token=torch.tensor([9, 1])
    )
    with debug_mode():
        out = buffers.refresh(ok, (3, 2))
    assert isinstance(out, SpecCommitMetadata)
    assert out.accepted_index.tolist() == [1, 0, -1]


def test_per_row_and_per_token_inputs_both_pad_a_narrower_step() -> None:
    # A per-row input keeps one row per request whatever the draft length; a per-token
    # input (here strided: the per-dtype copy path) has its columns [t:T) padded.
    buffers = _verify_buffers(
        optional_fields=(),
        inputs={
            "b": InputSpec((2,), torch.float32, pad=0.25),
            "h": InputSpec((2,), torch.float32, rows=TOKENS, pad=0.5),
        },
    )
    _junk(buffers)
    b = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    h = (torch.arange(16, dtype=torch.float32).view(4, 4) + 1)[:, ::2]  # stride 2
    md = buffers.refresh(_step([3, 5], 2), (3, 3), {"b": b, "h": h})
    assert md.mamba_cache_indices.tolist() == [3, 5, -1]
    views = buffers.views((3, 3))
    assert views["b"].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.25, 0.25]]
    grid = views["h"].view(3, 3, 2)
    assert grid[:2, :2].equal(h.reshape(2, 2, 2))
    assert (grid[:2, 2] == 0.5).all() and (grid[2] == 0.5).all()
