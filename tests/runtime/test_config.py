"""config.json parsing: supported layouts accepted, unsupported ones refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridmeta.runtime.config import ConfigError, NemotronHConfig, read_config
from hybridmeta.runtime.tiny import tiny_config


def _raw(**changes: Any) -> dict[str, Any]:
    raw = tiny_config().to_hf_dict()
    raw.update(changes)
    return raw


def test_round_trip_of_the_hf_dict() -> None:
    cfg = tiny_config()
    assert NemotronHConfig.from_dict(cfg.to_hf_dict()) == cfg


def test_layers_block_type_is_read_like_the_pattern() -> None:
    raw = _raw()
    del raw["hybrid_override_pattern"]
    del raw["num_hidden_layers"]
    raw["layers_block_type"] = ["mamba", "attention", "mlp", "linear_attention", "full_attention"]
    assert NemotronHConfig.from_dict(raw).pattern == "M*-M*"


def test_legacy_key_names_are_accepted() -> None:
    raw = _raw()
    raw["mamba_n_groups"] = raw.pop("n_groups")
    raw["mamba_d_conv"] = raw.pop("conv_kernel")
    raw["mamba_chunk_size"] = raw.pop("chunk_size")
    cfg = NemotronHConfig.from_dict(raw)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size) == (2, 4, 8)


def test_derived_sizes() -> None:
    cfg = tiny_config(pattern="M*M-")
    assert cfg.mamba_layers == (0, 2)
    assert cfg.attention_layers == (1,)
    assert (
        cfg.conv_dim
        == cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.n_groups * cfg.ssm_state_size
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hybrid_override_pattern": "M*E-"}, r"MoE 'E' layers are not supported"),
        ({"hybrid_override_pattern": "M*X"}, r"unknown layer letters \['X'\]"),
        ({"hybrid_override_pattern": ""}, r"'hybrid_override_pattern' must be a non-empty str"),
        ({"mlp_hidden_act": "gelu"}, r"'mlp_hidden_act' must be 'relu2'"),
        ({"mamba_hidden_act": "relu"}, r"'mamba_hidden_act' must be 'silu'"),
        ({"attention_bias": True}, r"'attention_bias' must be false"),
        ({"model_type": "llama"}, r"model_type must be 'nemotron_h'"),
        ({"vocab_size": 0}, r"'vocab_size' must be a positive int"),
        ({"num_key_value_heads": 3}, r"multiple of 'num_key_value_heads'"),
        ({"n_groups": 3}, r"'mamba_num_heads' must be a multiple of 'n_groups'"),
        ({"num_hidden_layers": 3}, r"'num_hidden_layers' is 3 but the layer pattern has 8"),
        ({"time_step_limit": [0.0, 0.1]}, r"'time_step_limit' must be \[min, inf\]"),
        ({"use_conv_bias": "yes"}, r"'use_conv_bias' must be a bool"),
    ],
)
def test_unsupported_configs_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NemotronHConfig.from_dict(_raw(**changes))


def test_missing_key_is_named() -> None:
    raw = _raw()
    del raw["ssm_state_size"]
    with pytest.raises(ConfigError, match=r"required key 'ssm_state_size' is missing"):
        NemotronHConfig.from_dict(raw)


def test_read_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_raw(hybrid_override_pattern="ME")))
    with pytest.raises(ConfigError, match=r"config\.json: .*MoE"):
        read_config(tmp_path)
