"""Static buffers: what the constructor accepts, refuses and allocates, and what the
per-step plans and bucket views it caches look like from outside."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import BATCH, INDEX, TOKENS, Pad, debug_mode, metadata, tensor_field
from hybridmeta.graphs import InputSpec, StaticBuffers, default_buckets
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, SpecCommitMetadata, prepare_decode
from tests.graphs.test_buffers import _buffers, _step, _x

# ----------------------------------------------------------------------- classes under test


@metadata
class _HostExtra(Mamba2Metadata):
    """Adds a host field: not bufferable."""

    note: int


@metadata
class _Wide(Mamba2Metadata):
    """Adds a 2-D per-row field without cols: its buffer shape is unknown."""

    wide: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), ndim=2)


@metadata
class _Scaled(Mamba2Metadata):
    """Adds a per-row float field: its buffer takes the first declared dtype."""

    scale: torch.Tensor = tensor_field(
        rows=BATCH, dtypes=(torch.float16, torch.float32), pad=Pad.value(1.0)
    )


@metadata(extension=True)
class _TwoDrafts(ForwardMetadata):
    """A second column-count host field beside draft_token_num."""

    alt_num: int = 1
    alt: torch.Tensor | None = tensor_field(
        rows=BATCH, cols="alt_num", dtypes=INDEX, pad=Pad.value(0), default=None
    )


def _verify(**kw: Any) -> StaticBuffers:
    args: dict[str, Any] = {
        "max_bs": 3,
        "num_slots": 8,
        "device": "cpu",
        "max_draft": 2,
        "static": {"is_target_verify": True},
        "inputs": {
            "h": InputSpec((2,), torch.float32, rows=TOKENS, pad=0.5),
            "b": InputSpec((1,), torch.float32, pad=0.25),
        },
    }
    args.update(kw)
    return StaticBuffers(**args)


# ----------------------------------------------------------------------- default buckets


@pytest.mark.parametrize(
    ("max_bs", "expected"),
    [(1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (6, (1, 2, 4, 6)), (8, (1, 2, 4, 8))],
)
def test_default_buckets_are_powers_of_two_then_max_bs(
    max_bs: int, expected: tuple[int, ...]
) -> None:
    assert default_buckets(max_bs) == expected


# ----------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_slots": True}, r"num_slots must be an int > 0, got True"),
        ({"num_slots": 2.5}, r"num_slots must be an int > 0, got 2\.5"),
        ({"max_draft": True}, r"max_draft must be an int > 0, got True"),
        ({"max_draft": 2.5}, r"max_draft must be an int > 0, got 2\.5"),
    ],
)
def test_sizes_must_be_plain_ints(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=r"^StaticBuffers: " + match + "$"):
        _buffers(**kw)


def test_one_row_and_one_slot_are_enough() -> None:
    buffers = _buffers(max_bs=1, num_slots=1)
    md = buffers.refresh(_step([0]), 1, _x(1))
    assert md.mamba_cache_indices.tolist() == [0]
    assert md.query_start_loc.tolist() == [0, 1]
    with pytest.raises(
        ValueError, match=r"mamba_cache_indices row 0 holds 1: not a slot in \[0, 1\)"
    ):
        buffers.refresh(_step([1]), 1, _x(1))


def test_public_attributes_describe_the_configuration() -> None:
    buffers = _verify(metadata_class=SpecCommitMetadata)
    assert buffers.metadata_class is SpecCommitMetadata
    assert _buffers().metadata_class is Mamba2Metadata
    # max_tokens is the row count of a per-token input: max_bs rows of max_draft tokens.
    assert buffers.max_tokens == 6 and type(buffers.max_tokens) is int
    assert buffers.snapshot()["h"].shape == (buffers.max_tokens, 2)


# ----------------------------------------------------------------------- declarations refused


def test_a_derived_class_adding_a_host_field_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers: _HostExtra\.note is not a per-row tensor field; a class derived "
        r"from Mamba2Metadata can be buffered only if every field it adds is one$",
    ):
        _buffers(metadata_class=_HostExtra)


def test_two_column_count_fields_are_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers: one draft dimension is supported, the fields declare columns "
        r"from \['alt_num', 'draft_token_num'\]$",
    ):
        _buffers(source=_TwoDrafts, optional_fields=("alt",))


def test_a_2d_per_row_field_without_cols_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers: per-row field 'wide' has 2 dimensions but declares no cols: "
        r"its buffer shape is unknown$",
    ):
        _buffers(metadata_class=_Wide, optional_fields=())


@pytest.mark.parametrize("name", ["nope", "conv_states_mask_indices", "query_start_loc"])
def test_optional_fields_must_name_optional_per_row_fields(name: str) -> None:
    # unknown; optional but not per-row; per-row but required
    with pytest.raises(
        ValueError,
        match=rf"^StaticBuffers: optional_fields entry '{name}' is not an optional per-row "
        r"field of Mamba2Metadata$",
    ):
        _buffers(optional_fields=(name,))


def test_cuda_without_cuda_names_the_way_out() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers: device cuda was asked for but CUDA is not available on this "
        r"machine \(use device='cpu': graphs are then emulated\)$",
    ):
        _buffers(device="cuda")


# ----------------------------------------------------------------------- allocation


def test_a_float_field_takes_its_first_declared_dtype() -> None:
    buffers = _buffers(metadata_class=_Scaled, optional_fields=(), inputs={})
    md = buffers.pad_all(2)
    assert isinstance(md, _Scaled)
    assert md.scale.dtype == torch.float16
    assert md.scale.tolist() == [1.0, 1.0]  # its declared pad
    step = _Scaled.evolve_from(
        prepare_decode(_step([3, 1])), scale=torch.tensor([0.5, 2.0], dtype=torch.float16)
    )
    out = buffers.refresh(step, 3)
    assert isinstance(out, _Scaled)
    assert out.scale.tolist() == [0.5, 2.0, 1.0]


def test_fresh_buffers_hold_padding_in_every_row() -> None:
    # Before any write every byte is what padding the widest bucket writes: offsets of
    # empty rows (0, a valid offsets array), slots -1, inputs their pad.
    buffers = _verify()
    fresh = buffers.snapshot()
    assert fresh["query_start_loc"].tolist() == [0] * 4
    buffers.refresh(
        ForwardMetadata(
            query_start_loc=torch.tensor([0, 2]),
            mamba_cache_indices=torch.tensor([5]),
            retrieve_next_token=torch.tensor([[1, -1]]),
            retrieve_next_sibling=torch.tensor([[-1, -1]]),
            is_target_verify=True,
            draft_token_num=2,
        ),
        (1, 2),
        {"h": torch.ones(2, 2), "b": torch.ones(1, 1)},
    )
    buffers.pad_all(3)  # the widest bucket: every row and column
    for name, t in buffers.snapshot().items():
        assert torch.equal(fresh[name], t), name


def test_buffers_live_on_the_device_asked_for_whatever_the_default_device() -> None:
    # An engine may build under `with torch.device(...)`: device= still decides.
    with torch.device("meta"):
        buffers = _buffers(device="cpu")
    devices = {name: t.device.type for name, t in buffers.snapshot().items()}
    assert {"query_start_loc", "mamba_cache_indices", "x"} <= set(devices)
    assert set(devices.values()) == {"cpu"}, devices
    md = buffers.refresh(_step([3, 1]), 3, _x(2))
    assert md.mamba_cache_indices.tolist() == [3, 1, -1]
    assert buffers.views(3)["x"].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]


# ----------------------------------------------------------------------- step path


def test_outside_debug_mode_the_offsets_are_the_steps_own() -> None:
    # A refresh copies the live offsets it is given (t == T), it does not recompute them;
    # checking them is debug mode's job, which refuses these (row 0 has 2 tokens).
    buffers = _buffers()
    step = _step([3, 1], query_start_loc=torch.tensor([0, 2, 3]))
    md = buffers.refresh(step, 3, _x(2))
    assert md.query_start_loc[:3].tolist() == [0, 2, 3]  # the live rows' offsets
    with debug_mode(), pytest.raises(ValueError, match="query_start_loc must give every row 1"):
        buffers.refresh(step, 3, _x(2))


def test_the_per_dtype_path_is_one_foreach_copy_per_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A strided input has no byte view: the copies go per dtype, each call one dtype.
    buffers = _buffers()
    dtypes: list[set[torch.dtype]] = []
    real = torch._foreach_copy_

    def record(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        dtypes.append({d.dtype for d in dsts})
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", record)
    strided_x = (torch.arange(8.0).reshape(2, 4) + 1)[:, ::2]
    md = buffers.refresh(_step([3, 1], [9, -1], [True, False]), 4, {"x": strided_x})
    assert len(dtypes) == 3 and all(len(d) == 1 for d in dtypes), dtypes
    assert set().union(*dtypes) == {torch.int64, torch.bool, torch.float32}
    assert md.mamba_cache_indices.tolist() == [3, 1, -1, -1]
    assert md.mamba_track_mask is not None
    assert md.mamba_track_mask.tolist() == [True, False, False, False]
    assert buffers.views(4)["x"].tolist() == [[1.0, 3.0], [5.0, 7.0], [0.0, 0.0], [0.0, 0.0]]


def test_a_bucket_hands_out_the_same_view_objects_every_time() -> None:
    # What a graph was captured on: debug mode rebuilds the metadata, on the same views.
    buffers = _buffers()
    a = buffers.refresh(_step([1, 2]), 4, _x(2))
    assert buffers.views(4)["x"] is buffers.views(4)["x"]
    with debug_mode():
        b = buffers.refresh(_step([5]), 4, _x(1))
    assert b is not a
    assert b.mamba_cache_indices is a.mamba_cache_indices
    assert b.mamba_cache_indices.tolist() == [5, -1, -1, -1]
