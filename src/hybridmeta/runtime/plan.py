"""The attention layers' own small plan of a prefill forward (the Mamba2 layers read
``Mamba2Metadata``, built by :mod:`hybridmeta.planner`).

Attention runs prefill rows on a padded ``[P, L]`` grid (``L`` the longest row). Its host
arrays are staged in the same single host-to-device copy as the forward's Mamba2
metadata (:func:`hybridmeta.staging.to_device_packed` over both), and its slots come from
that metadata (``md.prefill_slots``): no tensor travels twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

__all__ = ["AttentionHostPlan", "AttentionPlan", "attention_host_plan"]

_P = "attention."  # key prefix of the staged arrays


@attrs.frozen(kw_only=True, eq=False)
class AttentionPlan:
    """Device tensors describing the prefill rows of one forward for attention.

    Attributes
    ----------
    gather : torch.Tensor
        ``[P, L]`` index into the flat tokens; pad cells point at index ``T`` (one past
        the end: callers append a zero row).
    valid : torch.Tensor
        ``[P, L]`` bool: the cells that hold a token (derived from ``gather``).
    scatter : torch.Tensor
        ``[T]`` index of each flat token into the flattened ``[P*L]`` grid.
    token_row, token_pos : torch.Tensor
        ``[T]`` prefill row and absolute position of each flat token.
    starts : torch.Tensor
        ``[P]`` position of each row's first new token.
    last : torch.Tensor
        ``[P]`` flat index of each row's last token.
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    token_row: torch.Tensor
    token_pos: torch.Tensor
    starts: torch.Tensor
    last: torch.Tensor
    num_rows: int
    num_tokens: int
    padded_len: int

    @property
    def valid(self) -> torch.Tensor:
        return self.gather < self.num_tokens


@attrs.frozen(kw_only=True, eq=False)
class AttentionHostPlan:
    """Host arrays of an :class:`AttentionPlan` (stage :attr:`arrays`, then :meth:`plan`)."""

    arrays: dict[str, npt.NDArray[np.int64]]
    num_rows: int
    num_tokens: int
    padded_len: int

    def plan(self, views: Mapping[str, torch.Tensor]) -> AttentionPlan:
        """The plan over staged ``views`` of :attr:`arrays`."""
        v = {k[len(_P) :]: t for k, t in views.items() if k.startswith(_P)}
        return AttentionPlan(
            gather=v["gather"],
            scatter=v["scatter"],
            token_row=v["token_row"],
            token_pos=v["token_pos"],
            starts=v["starts"],
            last=v["last"],
            num_rows=self.num_rows,
            num_tokens=self.num_tokens,
            padded_len=self.padded_len,
        )


def attention_host_plan(lengths: Sequence[int], starts: Sequence[int]) -> AttentionHostPlan:
    """Host arrays of the attention plan of prefill rows ``lengths`` new tokens long that
    start at positions ``starts``.

    Raises
    ------
    ValueError
        No rows, or a row with ``length < 1`` or ``start < 0``.
    """
    if not lengths or len(lengths) != len(starts):
        raise ValueError(
            f"attention_host_plan: need one start per row and >= 1 row, got {len(lengths)} "
            f"lengths and {len(starts)} starts"
        )
    lens = np.asarray(lengths, dtype=np.int64)
    st = np.asarray(starts, dtype=np.int64)
    if (lens < 1).any() or (st < 0).any():
        raise ValueError("attention_host_plan: every row needs length >= 1 and start >= 0")
    p = lens.shape[0]
    t = int(lens.sum())
    padded = int(lens.max())
    offsets = np.cumsum(lens) - lens  # [P] first flat index per row
    col = np.arange(padded, dtype=np.int64)[None, :]
    valid = col < lens[:, None]  # [P, L]
    gather = np.where(valid, offsets[:, None] + col, t)
    token_row = np.repeat(np.arange(p, dtype=np.int64), lens)  # [T]
    col_of_token = np.arange(t, dtype=np.int64) - offsets[token_row]
    arrays = {
        "gather": gather,
        "scatter": token_row * padded + col_of_token,
        "token_row": token_row,
        "token_pos": st[token_row] + col_of_token,
        "starts": st,
        "last": offsets + lens - 1,
    }
    return AttentionHostPlan(
        arrays={_P + k: a for k, a in arrays.items()}, num_rows=p, num_tokens=t, padded_len=padded
    )
