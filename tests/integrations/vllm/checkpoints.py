"""Tiny checkpoints of every family vLLM serves through ``MambaMixer2``, written by
transformers' ``save_pretrained`` (fp32, seeded weights).

The default initialisation of transformers (std 0.02) makes near-uniform logits, where
greedy tokens are decided by rounding; the weights are re-drawn here with scales that
keep logits far from uniform and give the SSM fast and slow heads, so a wrong state or a
dropped row shows up as a different token, not as a near-tie.

Used by the vLLM integration tests and runnable by hand::

    python -m tests.integrations.vllm.checkpoints OUT_DIR [NAME ...]
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINTS", "Checkpoint", "write_checkpoint"]

VOCAB = 128
HIDDEN = 64


@dataclass(frozen=True)
class Checkpoint:
    """One tiny checkpoint: its name, family, Mamba2 shape and how to build its config."""

    name: str
    family: str
    n_groups: int
    chunk_size: int
    num_heads: int
    head_dim: int
    make_config: Callable[[], Any]

    def describe(self) -> str:
        return (
            f"{self.family}: {self.num_heads} heads of {self.head_dim}, {self.n_groups} "
            f"group(s), chunk {self.chunk_size}"
        )


def _nemotron_h(*, n_groups: int, chunk: int, heads: int, head_dim: int, pattern: str) -> Any:
    from transformers import NemotronHConfig

    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=96,
        ssm_state_size=16,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        n_groups=n_groups,
        conv_kernel=4,
        chunk_size=chunk,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _granite() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        shared_intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=1,
        num_key_value_heads=1,
        num_local_experts=0,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        max_position_embeddings=2048,
        position_embedding_type="nope",
        tie_word_embeddings=False,
    )


def _falcon_h1() -> Any:
    from transformers import FalconH1Config

    _extra: dict[str, Any] = {"head_dim": 64}  # not in every release's signature

    return FalconH1Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=1,
        num_key_value_heads=1,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        mamba_d_ssm=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **_extra,
    )


def _bamba() -> Any:
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=1,
        num_key_value_heads=1,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


CHECKPOINTS: dict[str, Checkpoint] = {
    c.name: c
    for c in (
        Checkpoint(
            "nemotron_h_g1_c32", "Nemotron-H", 1, 32, 4, 32,
            lambda: _nemotron_h(n_groups=1, chunk=32, heads=4, head_dim=32, pattern="M*M-M"),
        ),
        Checkpoint(
            "nemotron_h_g2_c64", "Nemotron-H", 2, 64, 4, 32,
            lambda: _nemotron_h(n_groups=2, chunk=64, heads=4, head_dim=32, pattern="M-M*M"),
        ),
        Checkpoint(
            "nemotron_h_g4_c32", "Nemotron-H", 4, 32, 8, 16,
            lambda: _nemotron_h(n_groups=4, chunk=32, heads=8, head_dim=16, pattern="MM*-M"),
        ),
        Checkpoint(
            "nemotron_3_moe", "Nemotron-3 (MoE)", 2, 32, 4, 32,
            lambda: _nemotron_h(n_groups=2, chunk=32, heads=4, head_dim=32, pattern="ME*EM"),
        ),
        Checkpoint("granite_4_h", "Granite 4.0-H", 1, 32, 4, 32, _granite),
        Checkpoint("falcon_h1", "Falcon-H1", 2, 32, 4, 32, _falcon_h1),
        Checkpoint("bamba", "Bamba", 1, 32, 4, 32, _bamba),
    )
}  # fmt: skip


@torch.no_grad()
def _reseed(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter with scales that keep logits far from uniform."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if leaf == "A_log":
            p.copy_(torch.log(torch.rand(shape, generator=g) * 7.0 + 1.0))
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(shape, generator=g) * math.log(30.0)) * 0.01
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif leaf == "D":
            p.copy_(1.0 + 0.2 * torch.randn(shape, generator=g))
        elif "norm" in name or "layernorm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(shape, generator=g))
        elif "conv1d.weight" in name:
            p.copy_(0.5 * torch.randn(shape, generator=g))
        elif leaf == "bias" or "correction_bias" in leaf:
            p.copy_(0.1 * torch.randn(shape, generator=g) if "conv" in name else torch.zeros(shape))
        elif "embed" in name:
            p.copy_(torch.randn(shape, generator=g))
        elif p.ndim >= 2:
            fan_in = shape[-1]
            scale = 2.0 if "lm_head" in name else 1.0
            p.copy_(scale * torch.randn(shape, generator=g) / math.sqrt(fan_in))
        else:
            p.copy_(0.1 * torch.randn(shape, generator=g))


def write_checkpoint(name: str, directory: str | Path, *, seed: int = 0) -> Path:
    """Write checkpoint ``name`` (fp32) into ``directory`` (created); returns it.

    Idempotent: an existing directory with the same recipe stamp is reused.
    """
    from transformers import AutoModelForCausalLM

    spec = CHECKPOINTS[name]
    root = Path(directory)
    stamp = root / "hybridmeta_recipe.json"
    recipe = {"name": name, "seed": seed, "shape": spec.describe(), "version": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return root
    cfg = spec.make_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)  # type: ignore[no-untyped-call]
    _reseed(model, seed)
    model.save_pretrained(str(root))
    stamp.write_text(json.dumps(recipe))
    return root


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out = Path(argv[0])
    for name in argv[1:] or list(CHECKPOINTS):
        print(write_checkpoint(name, out / name), CHECKPOINTS[name].describe())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
