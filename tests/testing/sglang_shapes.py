"""Our own reproduction of the shape of sglang 0.5.23's Mamba2 metadata classes.

Read from ``sglang/srt/layers/attention/mamba/mamba2_metadata.py`` (released wheel
0.5.23) for the field names, types and defaults, and for the shape of its
``prepare_decode``: a 32-field ``ForwardMetadata`` dataclass, a ``Mamba2Metadata`` subclass
adding the batch counts and the mixed-batch part, and a four-argument static
``prepare_decode(forward_metadata, seq_lens, *, is_target_verify, draft_token_num)`` that
re-lists 17 of the source fields by keyword and leaves the other 15 to their defaults.
Written here from that reading, not copied; the bodies are ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The fields prepare_decode passes on: 14 re-listed from the source, plus the two flags
#: it takes as keyword arguments, plus has_mamba_track_mask.
PASSED = (
    "query_start_loc",
    "mamba_cache_indices",
    "mamba_track_indices",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "retrieve_parent_token",
    "track_conv_indices",
    "track_ssm_h_src",
    "track_ssm_h_dst",
    "track_ssm_final_src",
    "track_ssm_final_dst",
    "track_ssm_seq_idx",
    "track_ssm_end_locs",
    "track_ssm_recompute_dst",
    "has_mamba_track_mask",
    "is_target_verify",
    "draft_token_num",
)

#: The 15 source fields sglang 0.5.23's prepare_decode does not pass (what
#: ``hybridmeta audit`` reports on the real file, benchmarks/results/audit_engines.md).
DROPPED = (
    "conv_block_table",
    "logical_num_tokens",
    "mamba_cache_indices_gdn",
    "replayssm_write_pos",
    "replayssm_force_flush",
    "track_chunk_idx",
    "track_ssm_h_batch_src",
    "state_checkpoint_cu_starts",
    "num_state_checkpoints",
    "state_checkpoint_every_n_tokens",
    "state_checkpoint_indices",
    "fused_accept_state_indices",
    "fused_accept_num_accepted",
    "mamba_track_mask_indices",
    "conv_states_mask_indices",
)


@dataclass(kw_only=True)
class ForwardMetadata:
    query_start_loc: torch.Tensor
    mamba_cache_indices: torch.Tensor
    conv_block_table: torch.Tensor | None = None
    logical_num_tokens: int | None = None
    mamba_cache_indices_gdn: torch.Tensor | None = None
    mamba_track_indices: torch.Tensor | None = None
    replayssm_write_pos: torch.Tensor | None = None
    replayssm_force_flush: torch.Tensor | None = None
    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None
    retrieve_parent_token: torch.Tensor | None = None
    track_conv_indices: torch.Tensor | None = None
    track_ssm_h_src: torch.Tensor | None = None
    track_ssm_h_dst: torch.Tensor | None = None
    track_ssm_final_src: torch.Tensor | None = None
    track_ssm_final_dst: torch.Tensor | None = None
    track_chunk_idx: torch.Tensor | None = None
    track_ssm_h_batch_src: torch.Tensor | None = None
    state_checkpoint_cu_starts: torch.Tensor | None = None
    num_state_checkpoints: int = 0
    state_checkpoint_every_n_tokens: int = 0
    state_checkpoint_indices: torch.Tensor | None = None
    track_ssm_seq_idx: torch.Tensor | None = None
    track_ssm_end_locs: torch.Tensor | None = None
    track_ssm_recompute_dst: torch.Tensor | None = None
    is_target_verify: bool = False
    draft_token_num: int = 1
    fused_accept_state_indices: torch.Tensor | None = None
    fused_accept_num_accepted: torch.Tensor | None = None
    has_mamba_track_mask: bool = False
    mamba_track_mask_indices: torch.Tensor | None = None
    conv_states_mask_indices: torch.Tensor | None = None


@dataclass(kw_only=True, frozen=True)
class MixedMetadata:
    has_initial_states: torch.Tensor
    prep_initial_states: bool
    chunk_size: int
    seq_idx: torch.Tensor


@dataclass(kw_only=True)
class Mamba2Metadata(ForwardMetadata):
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    mixed_metadata: MixedMetadata | None = None

    @staticmethod
    def prepare_decode(
        forward_metadata: ForwardMetadata,
        seq_lens: torch.Tensor,
        *,
        is_target_verify: bool,
        draft_token_num: int,
    ) -> Mamba2Metadata:
        """Decode-only metadata, sglang's four-argument shape: 17 fields passed, 15 not."""
        passed = {
            name: getattr(forward_metadata, name)
            for name in PASSED
            if name not in ("is_target_verify", "draft_token_num")
        }
        return Mamba2Metadata(
            **passed,
            num_decodes=len(seq_lens),
            num_prefills=0,
            num_prefill_tokens=0,
            is_target_verify=is_target_verify,
            draft_token_num=draft_token_num,
        )

    @staticmethod
    def prepare_decode_fixed(
        forward_metadata: ForwardMetadata,
        seq_lens: torch.Tensor,
        *,
        is_target_verify: bool,
        draft_token_num: int,
    ) -> Mamba2Metadata:
        """The same constructor with every source field passed on."""
        out = Mamba2Metadata.prepare_decode(
            forward_metadata, seq_lens, is_target_verify=is_target_verify,
            draft_token_num=draft_token_num,
        )  # fmt: skip
        for name in DROPPED:
            setattr(out, name, getattr(forward_metadata, name))
        return out
