"""Nemotron-H model configuration as read from a Hugging Face ``config.json``.

Only what the reference runtime supports is accepted: Mamba2 mixer (``M``), attention
(``*``) and MLP (``-``) layers. Anything else (MoE ``E`` layers, other activations,
biases the reference implementation ignores) is refused with a message naming the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["LAYER_KINDS", "ConfigError", "NemotronHConfig", "read_config"]

#: layer pattern letter -> layer kind
LAYER_KINDS: dict[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_TYPES: dict[str, str] = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}
_SUPPORTED = frozenset("M*-")

# Keys renamed over the model's history (legacy name -> current name), as transformers reads them.
_LEGACY_KEYS: dict[str, str] = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_limit": "time_step_limit",
    "attention_head_dim": "head_dim",
}


class ConfigError(ValueError):
    """A ``config.json`` the runtime cannot serve; the message names the key and the rule."""


@attrs.frozen(kw_only=True)
class NemotronHConfig:
    """The subset of a Nemotron-H configuration the reference runtime uses.

    Attributes mirror the ``transformers`` ``NemotronHConfig`` names.
    """

    vocab_size: int
    hidden_size: int
    pattern: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    layer_norm_epsilon: float
    use_conv_bias: bool
    use_bias: bool
    mlp_bias: bool
    time_step_min: float
    tie_word_embeddings: bool

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_intermediate(self) -> int:
        """Width of the SSM input/output (``mamba_num_heads * mamba_head_dim``)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv1d: x, B and C together."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.pattern) if c == "M")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.pattern) if c == "*")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> NemotronHConfig:
        """Validate a parsed ``config.json`` and build the configuration.

        Raises
        ------
        ConfigError
            A required key is missing, has the wrong type, or asks for something the
            runtime does not support (MoE layers, non-``relu2`` MLPs, ...).
        """
        cfg: dict[str, Any] = dict(raw)
        for old, new in _LEGACY_KEYS.items():
            if old in cfg and cfg.get(new) is None:
                cfg[new] = cfg[old]

        model_type = cfg.get("model_type")
        if model_type is not None and model_type != "nemotron_h":
            raise ConfigError(f"config.json: model_type must be 'nemotron_h', got {model_type!r}")
        pattern = _read_pattern(cfg)

        def need_int(key: str, default: int | None = None) -> int:
            value = cfg.get(key, default)
            if value is None:
                raise ConfigError(f"config.json: required key {key!r} is missing")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {key!r} must be a positive int, got {value!r}")
            return value

        def need_bool(key: str, default: bool) -> bool:
            value = cfg.get(key, default)
            if not isinstance(value, bool):
                raise ConfigError(f"config.json: {key!r} must be a bool, got {value!r}")
            return value

        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            got = cfg.get(key, want)
            if got != want:
                raise ConfigError(f"config.json: {key!r} must be {want!r} (unsupported: {got!r})")
        if cfg.get("attention_bias", False):
            raise ConfigError(
                "config.json: 'attention_bias' must be false (Nemotron-H attention has no bias)"
            )
        if cfg.get("sliding_window") is not None:
            raise ConfigError("config.json: 'sliding_window' must be null (unsupported)")

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads", 1)
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            head_dim = hidden // heads
        limit = cfg.get("time_step_limit")
        t_min = cfg.get("time_step_min", 0.001)
        if not isinstance(t_min, int | float) or t_min < 0:
            raise ConfigError(f"config.json: 'time_step_min' must be a number >= 0, got {t_min!r}")
        if limit is not None and (
            not isinstance(limit, list | tuple)
            or len(limit) != 2
            or not math.isinf(float(limit[1]))
        ):
            raise ConfigError(
                f"config.json: 'time_step_limit' must be [min, inf] (an upper limit is unsupported), "
                f"got {limit!r}"
            )

        config = cls(
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            pattern=pattern,
            num_attention_heads=heads,
            num_key_value_heads=need_int("num_key_value_heads", heads),
            head_dim=int(head_dim),
            intermediate_size=need_int("intermediate_size"),
            mamba_num_heads=need_int("mamba_num_heads"),
            mamba_head_dim=need_int("mamba_head_dim"),
            ssm_state_size=need_int("ssm_state_size"),
            n_groups=need_int("n_groups"),
            conv_kernel=need_int("conv_kernel"),
            chunk_size=need_int("chunk_size"),
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            use_conv_bias=need_bool("use_conv_bias", True),
            use_bias=need_bool("use_bias", False),
            mlp_bias=need_bool("mlp_bias", False),
            time_step_min=float(t_min),
            tie_word_embeddings=need_bool("tie_word_embeddings", False),
        )
        if config.num_attention_heads % config.num_key_value_heads:
            raise ConfigError(
                "config.json: 'num_attention_heads' must be a multiple of 'num_key_value_heads', "
                f"got {config.num_attention_heads} and {config.num_key_value_heads}"
            )
        if config.mamba_num_heads % config.n_groups:
            raise ConfigError(
                "config.json: 'mamba_num_heads' must be a multiple of 'n_groups', "
                f"got {config.mamba_num_heads} and {config.n_groups}"
            )
        if config.conv_kernel < 2:
            raise ConfigError(f"config.json: 'conv_kernel' must be >= 2, got {config.conv_kernel}")
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content a Hugging Face Nemotron-H checkpoint carries."""
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "hybrid_override_pattern": self.pattern,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "mlp_hidden_act": "relu2",
            "mamba_hidden_act": "silu",
            "mamba_num_heads": self.mamba_num_heads,
            "mamba_head_dim": self.mamba_head_dim,
            "ssm_state_size": self.ssm_state_size,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "expand": 2,
            "chunk_size": self.chunk_size,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "use_conv_bias": self.use_conv_bias,
            "use_bias": self.use_bias,
            "mlp_bias": self.mlp_bias,
            "attention_bias": False,
            "time_step_min": self.time_step_min,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def _read_pattern(cfg: Mapping[str, Any]) -> str:
    raw = cfg.get("hybrid_override_pattern")
    if raw is None:
        types = cfg.get("layers_block_type", cfg.get("layer_types"))
        if types is None:
            raise ConfigError(
                "config.json: one of 'hybrid_override_pattern' or 'layers_block_type' is required"
            )
        if not isinstance(types, list) or any(t not in _BLOCK_TYPES for t in types):
            raise ConfigError(
                f"config.json: 'layers_block_type' must list {sorted(_BLOCK_TYPES)}, got {types!r}"
            )
        raw = "".join(_BLOCK_TYPES[t] for t in types)
    if not isinstance(raw, str) or not raw:
        raise ConfigError(
            f"config.json: 'hybrid_override_pattern' must be a non-empty str, got {raw!r}"
        )
    unknown = sorted(set(raw) - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(
            f"config.json: 'hybrid_override_pattern' has unknown layer letters {unknown} "
            f"(known: M=mamba, *=attention, -=mlp, E=moe)"
        )
    unsupported = sorted(set(raw) - _SUPPORTED)
    if unsupported:
        where = [i for i, c in enumerate(raw) if c not in _SUPPORTED]
        raise ConfigError(
            f"config.json: 'hybrid_override_pattern' has layers of kind {unsupported} at "
            f"{where[:8]}; the reference runtime supports only M (Mamba2), * (attention) and "
            f"- (MLP) layers (MoE 'E' layers are not supported)"
        )
    num = cfg.get("num_hidden_layers")
    if isinstance(num, int) and num != len(raw) and "layers_block_type" not in cfg:
        raise ConfigError(
            f"config.json: 'num_hidden_layers' is {num} but the layer pattern has {len(raw)} layers"
        )
    return raw


def read_config(model_dir: str | Path) -> NemotronHConfig:
    """Read and validate ``model_dir/config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    with path.open() as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    try:
        return NemotronHConfig.from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
