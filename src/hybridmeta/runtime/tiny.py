"""The embedded default model: a tiny seeded Nemotron-H checkpoint in the Hugging Face format.

:func:`write_tiny_checkpoint` writes ``config.json`` and ``model.safetensors`` with the
parameter names of NVIDIA's checkpoints (``backbone.*``, ``lm_head.weight``); the runtime
then loads it through the same loader as a real checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridmeta.runtime.config import NemotronHConfig

__all__ = ["TINY_CONFIG", "tiny_config", "tiny_state_dict", "write_tiny_checkpoint"]


def tiny_config(*, pattern: str = "M*M-M*-M", chunk_size: int = 8) -> NemotronHConfig:
    """A small Nemotron-H shape that exercises every supported layer kind and GQA."""
    return NemotronHConfig(
        vocab_size=96,
        hidden_size=32,
        pattern=pattern,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=chunk_size,
        layer_norm_epsilon=1e-5,
        use_conv_bias=True,
        use_bias=False,
        mlp_bias=False,
        time_step_min=0.001,
        tie_word_embeddings=False,
    )


TINY_CONFIG = tiny_config()


def tiny_state_dict(config: NemotronHConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights with checkpoint names (``backbone.`` prefix).

    Scales are chosen so logits are far from uniform and the SSM has both fast and slow
    heads: a stale or wrong state shows up as a large KL, not a rounding error.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(out: int, inp: int) -> torch.Tensor:
        return normal(out, inp, std=1.0 / math.sqrt(inp))

    h = config.hidden_size
    sd: dict[str, torch.Tensor] = {
        "backbone.embeddings.weight": normal(config.vocab_size, h, std=1.0)
    }
    for i, kind in enumerate(config.pattern):
        pre = f"backbone.layers.{i}."
        sd[pre + "norm.weight"] = 1.0 + normal(h, std=0.1)
        m = pre + "mixer."
        if kind == "M":
            inner = config.mamba_intermediate
            nh = config.mamba_num_heads
            sd[m + "in_proj.weight"] = linear(inner + config.conv_dim + nh, h)
            sd[m + "conv1d.weight"] = normal(config.conv_dim, 1, config.conv_kernel, std=0.5)
            if config.use_conv_bias:
                sd[m + "conv1d.bias"] = normal(config.conv_dim, std=0.1)
            # dt in [0.01, 0.3]: some heads forget within a chunk, some carry state far
            dt = torch.exp(torch.rand(nh, generator=g) * math.log(30.0)) * 0.01
            sd[m + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            sd[m + "A_log"] = torch.log(torch.rand(nh, generator=g) * 7.0 + 1.0)
            sd[m + "D"] = 1.0 + normal(nh, std=0.2)
            sd[m + "norm.weight"] = 1.0 + normal(inner, std=0.1)
            sd[m + "out_proj.weight"] = linear(h, inner)
        elif kind == "*":
            qd = config.num_attention_heads * config.head_dim
            kvd = config.num_key_value_heads * config.head_dim
            sd[m + "q_proj.weight"] = linear(qd, h)
            sd[m + "k_proj.weight"] = linear(kvd, h)
            sd[m + "v_proj.weight"] = linear(kvd, h)
            sd[m + "o_proj.weight"] = linear(h, qd)
        elif kind == "-":
            sd[m + "up_proj.weight"] = linear(config.intermediate_size, h)
            sd[m + "down_proj.weight"] = linear(h, config.intermediate_size)
        else:
            raise ValueError(f"tiny_state_dict: unsupported layer kind {kind!r}")
    sd["backbone.norm_f.weight"] = 1.0 + normal(h, std=0.1)
    sd["lm_head.weight"] = linear(config.vocab_size, h) * 2.0
    return sd


def write_tiny_checkpoint(
    directory: str | Path, *, config: NemotronHConfig | None = None, seed: int = 0
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of the tiny model into ``directory``."""
    cfg = config if config is not None else TINY_CONFIG
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with (root / "config.json").open("w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    tensors = {k: v.contiguous() for k, v in tiny_state_dict(cfg, seed).items()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root
