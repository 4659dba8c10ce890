"""State storage of the reference runtime: one pool of slots for Mamba state and attention KV.

Slots ``0 .. num_working - 1`` are working slots (one per running request); the rest are
track slots that hold a snapshot of a request's state at a track boundary for the prefix
cache. Pad rows carry slot ``-1``, as everywhere in hybridmeta: the Mamba2 ops read and
write nothing for them. The attention KV pool (the runtime's attention, not a Mamba2 op)
has one scratch row past the last slot, which index ``-1`` addresses, so a padded
attention row writes there and never into a live slot. Ownership is enforced by
:class:`SlotAllocator`: a slot is handed out once and must be freed before it is handed
out again.
"""

from __future__ import annotations

import attrs
import torch

from hybridmeta.runtime.config import NemotronHConfig

__all__ = ["OutOfSlotsError", "SlotAllocator", "StatePool"]


class OutOfSlotsError(RuntimeError):
    """No free slot of the requested kind."""


class SlotAllocator:
    """Free list over a contiguous range of slot ids ``[first, first + count)``."""

    def __init__(self, first: int, count: int, kind: str) -> None:
        if count < 1:
            raise ValueError(f"SlotAllocator: {kind} slot count must be >= 1, got {count}")
        self.kind = kind
        self.first = first
        self.count = count
        # lowest ids first so reuse is easy to see in tests
        self._free: list[int] = list(range(first + count - 1, first - 1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlotsError(f"no free {self.kind} slot (all {self.count} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"SlotAllocator: {self.kind} slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)


@attrs.define(eq=False)
class StatePool:
    """All per-slot state tensors of the model.

    Attributes
    ----------
    conv : torch.Tensor
        ``[L_mamba, S, conv_dim, K-1]`` conv inputs preceding the next token (model dtype).
    ssm : torch.Tensor
        ``[L_mamba, S, H, D, N]`` fp32 SSM states.
    k, v : torch.Tensor
        ``[L_attn, S + 1, max_len, KVH, head_dim]`` attention KV by slot and position; row
        ``S`` (index ``-1``) is the pad rows' scratch.
    inter_conv, inter_ssm : torch.Tensor or None
        Speculative verify only: ``[L_mamba, R, T, conv_dim, K-1]`` (model dtype) and
        ``[L_mamba, R, T, H, D, N]`` (fp32) states after each of ``T`` draft tokens of each of
        ``R`` verify rows, per row (not per slot); the commit copies the accepted ones into
        the slots. ``None`` without speculative decoding.
    """

    conv: torch.Tensor
    ssm: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_working: int
    num_track: int
    max_len: int
    inter_conv: torch.Tensor | None = None
    inter_ssm: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        config: NemotronHConfig,
        *,
        num_working: int,
        num_track: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        verify_rows: int = 0,
        verify_tokens: int = 0,
    ) -> StatePool:
        """Allocate zeroed storage for ``num_working + num_track`` slots, and intermediate
        states for ``verify_rows`` rows of ``verify_tokens`` draft tokens when both are > 0."""
        if num_working < 1:
            raise ValueError(f"StatePool: num_working must be >= 1, got {num_working}")
        if num_track < 0:
            raise ValueError(f"StatePool: num_track must be >= 0, got {num_track}")
        if max_len < 1:
            raise ValueError(f"StatePool: max_len must be >= 1, got {max_len}")
        s = num_working + num_track
        lm = max(len(config.mamba_layers), 1)
        la = max(len(config.attention_layers), 1)
        conv = torch.zeros(
            lm, s, config.conv_dim, config.conv_kernel - 1, device=device, dtype=dtype
        )
        ssm = torch.zeros(
            lm,
            s,
            config.mamba_num_heads,
            config.mamba_head_dim,
            config.ssm_state_size,
            device=device,
            dtype=torch.float32,
        )
        kv_shape = (la, s + 1, max_len, config.num_key_value_heads, config.head_dim)
        k = torch.zeros(kv_shape, device=device, dtype=dtype)
        v = torch.zeros(kv_shape, device=device, dtype=dtype)
        if verify_rows < 0 or verify_tokens < 0:
            raise ValueError(
                f"StatePool: verify_rows and verify_tokens must be >= 0, got {verify_rows} and "
                f"{verify_tokens}"
            )
        inter_conv = inter_ssm = None
        if verify_rows and verify_tokens:
            rt = (lm, verify_rows, verify_tokens)
            inter_conv = torch.zeros(
                *rt, config.conv_dim, config.conv_kernel - 1, device=device, dtype=dtype
            )
            inter_ssm = torch.zeros(
                *rt,
                config.mamba_num_heads,
                config.mamba_head_dim,
                config.ssm_state_size,
                device=device,
                dtype=torch.float32,
            )
        return cls(conv, ssm, k, v, num_working, num_track, max_len, inter_conv, inter_ssm)

    def verify_states(self, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inter_conv, inter_ssm)`` views of exactly ``rows`` verify rows and ``tokens``
        draft columns (what a verify forward of that shape writes and its commit reads)."""
        if self.inter_conv is None or self.inter_ssm is None:
            raise ValueError(
                "StatePool: no intermediate-state buffers (allocate with verify_rows and "
                "verify_tokens for speculative decoding)"
            )
        max_rows, max_tokens = self.inter_ssm.shape[1:3]
        if not (0 < rows <= max_rows and 0 < tokens <= max_tokens):
            raise ValueError(
                f"StatePool: a verify of {rows} rows x {tokens} tokens does not fit the "
                f"intermediate-state buffers ({max_rows} x {max_tokens})"
            )
        return self.inter_conv[:, :rows, :tokens], self.inter_ssm[:, :rows, :tokens]

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole slots ``src[i] -> dst[i]`` in every layer (conv, SSM and KV).

        ``src`` and ``dst`` are int64 index tensors on the pool's device of equal length;
        ``dst`` must not repeat or overlap ``src`` (the caller's plan guarantees it).
        """
        self._copy((self.conv, self.ssm, self.k, self.v), src, dst)

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the attention KV rows of slots ``src[i] -> dst[i]`` (all layers, all positions)."""
        self._copy((self.k, self.v), src, dst)

    @staticmethod
    def _copy(tensors: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(
                f"StatePool: src and dst slot indices must be 1-D of equal length, "
                f"got {tuple(src.shape)} and {tuple(dst.shape)}"
            )
        for t in tensors:
            t.index_copy_(1, dst, t.index_select(1, src))
