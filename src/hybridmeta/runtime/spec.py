"""Speculative decoding in the reference runtime: n-gram drafts, the verify plan, acceptance.

One speculative step of a decode row (the engine's :meth:`Runtime._verify
<hybridmeta.runtime.engine.Runtime>` drives it):

1. **Draft** (host, no second model): :func:`ngram_draft` looks the row's last ``n`` tokens
   up earlier in its own history (prompt lookup) and proposes the tokens that followed.
2. **Verify**: one forward of ``T = 1 + max drafts`` tokens per row -- the row's pending
   token (sampled last step, not yet in the state) followed by its draft, padded to ``T``
   -- through :meth:`~hybridmeta.runtime.model.NemotronH.forward_verify`, planned by
   :func:`plan_spec_step` (the library planner's target-verify plan,
   :func:`hybridmeta.planner.plan_verify_host`, plus the tokens and the acceptance
   inputs: one host-to-device copy for all of them).
3. **Accept** (device, greedy): :func:`greedy_accept` keeps the longest prefix of the
   draft that equals the target's choice at each position (the argmax, or a forced token);
   the target's choice after it is the bonus token. ``k`` accepted drafts give ``k + 1``
   new tokens and leave the state after column ``k`` to commit.
4. **Commit**: ``prepare_commit(verify_md, accepted_index=k,
   track_token=spec_track_token(...))`` (``SpecCommitMetadata.evolve_from``) and
   :func:`~hybridmeta.kernels.spec_commit_from_metadata`:
   the working slot takes the state after column ``k``; a row whose accepted tokens cross a
   prefix-cache track boundary saves the state of exactly the boundary token into its
   track slot.

Everything a row's acceptance needs stays on the device until the step's single
device-to-host transfer of the chosen tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.planner import VerifyHostPlan, plan_verify_host

__all__ = ["Accepted", "SpecStepPlan", "greedy_accept", "ngram_draft", "plan_spec_step"]

IntArray = npt.NDArray[np.int64]
_P = "spec."  # key prefix of the staged arrays


def ngram_draft(
    tokens: Sequence[int], k: int, *, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Prompt-lookup draft: the ``k`` tokens that followed the latest earlier occurrence of
    the longest suffix of ``tokens`` (``max_ngram`` down to ``min_ngram`` tokens).

    An occurrence ``p`` tokens before the suffix says the sequence repeated with period
    ``p`` there; where its continuation runs into the suffix itself (``p < k``, a loop such
    as ``a b a b``), the draft keeps repeating the last ``p`` tokens, so it always has ``k``
    tokens. Returns ``[]`` when ``k <= 0`` or no suffix occurs earlier.
    """
    if k <= 0:
        return []
    toks = list(tokens)
    n_tok = len(toks)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        pattern = toks[n_tok - n :]
        # The latest occurrence that starts before the suffix does.
        for i in range(n_tok - n - 1, -1, -1):
            if toks[i : i + n] == pattern:
                period = n_tok - n - i
                return [toks[i + n + (j % period)] for j in range(k)]
    return []


@attrs.frozen(kw_only=True, eq=False)
class SpecStepPlan:
    """A verify step planned on the host: the forward (the library planner's
    :class:`~hybridmeta.planner.VerifyHostPlan`) and the runtime's own arrays, staged
    together in one host-to-device copy (:attr:`staged_arrays`).

    Attributes
    ----------
    verify : VerifyHostPlan
        The verify forward's metadata plan.
    arrays : dict of str to numpy array
        Int64 arrays keyed ``"spec.<name>"``: ``input_ids`` and ``positions`` (``[B * T]``),
        ``targets`` (``[B * T]``, forced tokens or ``-1``), ``num_draft`` and ``seq_lens``
        (``[B]``).
    """

    verify: VerifyHostPlan
    arrays: dict[str, IntArray]

    @property
    def staged_arrays(self) -> dict[str, IntArray]:
        """Everything to stage: the forward's arrays and the runtime's."""
        return {**self.verify.arrays, **self.arrays}

    def views(self, staged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The runtime's staged arrays by name (prefix removed)."""
        return {k[len(_P) :]: t for k, t in staged.items() if k.startswith(_P)}


def plan_spec_step(
    *,
    slots: Sequence[int],
    seq_lens: Sequence[int],
    tokens: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    num_draft: Sequence[int],
    track_mask: Sequence[bool] | None = None,
    track_slots: Sequence[int] | None = None,
) -> SpecStepPlan:
    """Plan one verify step from host data (no device work).

    Parameters
    ----------
    slots : sequence of int
        ``[B]`` working slot of each row (distinct, >= 0).
    seq_lens : sequence of int
        ``[B]`` tokens already in each row's state; row ``b``'s tokens take positions
        ``seq_lens[b] .. seq_lens[b] + T - 1``.
    tokens : sequence of sequence of int
        ``[B, T]`` pending token then draft (padded) of each row.
    targets : sequence of sequence of int
        ``[B, T]`` forced choice at each column (teacher forcing) or ``-1`` (greedy).
    num_draft : sequence of int
        ``[B]`` real draft tokens of each row (``<= T - 1``); the rest is padding.
    track_mask, track_slots : sequence, optional
        ``[B]`` rows that may cross a track boundary, and their reserved track slots.

    Raises
    ------
    ValueError
        Ragged or inconsistent rows (the message names the argument).
    """
    widths = {len(row) for row in tokens}
    if len(widths) > 1:
        raise ValueError(
            f"plan_spec_step: tokens must be [B, T] (every row T tokens), got widths {sorted(widths)}"
        )
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"plan_spec_step: tokens must be [B, T] with B, T >= 1, got {ids.shape}")
    bs, T = ids.shape
    pos0 = np.asarray(seq_lens, dtype=np.int64)
    nd = np.asarray(num_draft, dtype=np.int64)
    tgt = np.asarray(targets, dtype=np.int64)
    for name, arr, shape in (("seq_lens", pos0, (bs,)), ("num_draft", nd, (bs,)),
                             ("targets", tgt, (bs, T))):  # fmt: skip
        if arr.shape != shape:
            raise ValueError(f"plan_spec_step: {name} must have shape {shape}, got {arr.shape}")
    if (nd < 0).any() or (nd > T - 1).any():
        raise ValueError(f"plan_spec_step: num_draft must lie in [0, T - 1 = {T - 1}]")
    verify = plan_verify_host(
        slots=slots, draft_token_num=T, track_mask=track_mask, track_slots=track_slots
    )
    if verify.num_rows != bs:
        raise ValueError(f"plan_spec_step: slots has {verify.num_rows} rows, tokens {bs}")
    arrays = {
        "input_ids": ids.reshape(-1),
        "positions": (pos0[:, None] + np.arange(T, dtype=np.int64)[None, :]).reshape(-1),
        "targets": tgt.reshape(-1),
        "num_draft": nd,
        "seq_lens": pos0,
    }
    return SpecStepPlan(verify=verify, arrays={_P + k: a for k, a in arrays.items()})


@attrs.frozen(kw_only=True, eq=False)
class Accepted:
    """Device-side verdict of a verify forward.

    Attributes
    ----------
    logprobs : torch.Tensor
        ``[B, T, V]`` fp32 log-probabilities at every column.
    choice : torch.Tensor
        ``[B, T]`` the target's token at every column (forced, else the argmax).
    num_accepted : torch.Tensor
        ``[B]`` accepted draft tokens ``k`` (the state after column ``k`` is committed; the
        row gains ``choice[b, :k + 1]``).
    """

    logprobs: torch.Tensor
    choice: torch.Tensor
    num_accepted: torch.Tensor


def greedy_accept(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    num_draft: torch.Tensor,
) -> Accepted:
    """Greedy acceptance on the device (no host sync).

    Parameters
    ----------
    logits : torch.Tensor
        ``[B * T, V]`` verify logits.
    input_ids : torch.Tensor
        ``[B * T]`` the verified tokens (pending token, then the draft).
    targets : torch.Tensor
        ``[B * T]`` forced choices or ``-1``.
    num_draft : torch.Tensor
        ``[B]`` real draft tokens of each row.
    """
    bs = num_draft.shape[0]
    T = input_ids.shape[0] // bs
    logp = logits.float().view(bs, T, -1).log_softmax(-1)  # [B, T, V]
    tgt = targets.view(bs, T)
    choice = torch.where(tgt >= 0, tgt, logp.argmax(-1))  # [B, T]
    ids = input_ids.view(bs, T)
    col = torch.arange(T - 1, device=ids.device)
    # Draft token t + 1 is accepted when it is the target's choice after token t, and all
    # before it were: the length of the leading run of matches.
    match = (choice[:, :-1] == ids[:, 1:]) & (col[None, :] < num_draft[:, None])  # [B, T-1]
    k = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    return Accepted(logprobs=logp, choice=choice, num_accepted=k)
