"""config.json parsing: supported layouts accepted, unsupported ones refused by name."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from hybridmeta.runtime.config import (
    MAX_SIZE,
    ConfigError,
    NemotronHConfig,
    as_float,
    check_regular_file,
    read_config,
    read_json,
)
from hybridmeta.runtime.tiny import tiny_config, write_tiny_checkpoint


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
        ({"vocab_size": 0}, r"'vocab_size' must be a positive int, got 0"),
        ({"vocab_size": -3}, r"'vocab_size' must be a positive int, got -3"),
        ({"vocab_size": 2**31}, r"'vocab_size' must be a positive int <= 2\*\*31 - 1"),
        ({"vocab_size": 96.0}, r"'vocab_size' must be a positive int, got 96\.0"),
        ({"hidden_size": True}, r"'hidden_size' must be a positive int, got True"),
        ({"head_dim": "eight"}, r"'head_dim' must be a positive int, got 'eight'"),
        ({"head_dim": 0}, r"'head_dim' must be a positive int, got 0"),
        ({"num_attention_heads": 0}, r"'num_attention_heads' must be a positive int, got 0"),
        ({"num_key_value_heads": "2"}, r"'num_key_value_heads' must be a positive int, got '2'"),
        ({"intermediate_size": None}, r"'intermediate_size' must be a positive int, got None"),
        ({"mamba_num_heads": 0}, r"'mamba_num_heads' must be a positive int, got 0"),
        ({"mamba_head_dim": [8]}, r"'mamba_head_dim' must be a positive int, got \[8\]"),
        ({"ssm_state_size": 0}, r"'ssm_state_size' must be a positive int, got 0"),
        ({"n_groups": 0}, r"'n_groups' must be a positive int, got 0"),
        ({"chunk_size": 0}, r"'chunk_size' must be a positive int, got 0"),
        ({"conv_kernel": 1}, r"'conv_kernel' must be an int >= 2, got 1"),
        ({"num_hidden_layers": "8"}, r"'num_hidden_layers' must be a positive int, got '8'"),
        (
            {"layer_norm_epsilon": "tiny"},
            r"'layer_norm_epsilon' must be a finite number > 0, got 'tiny'",
        ),
        ({"layer_norm_epsilon": 0}, r"'layer_norm_epsilon' must be a finite number > 0, got 0"),
        ({"layer_norm_epsilon": -1e-5}, r"'layer_norm_epsilon' must be a finite number > 0"),
        (
            {"layer_norm_epsilon": math.inf},
            r"'layer_norm_epsilon' must be a finite number > 0, got inf",
        ),
        (
            {"layer_norm_epsilon": math.nan},
            r"'layer_norm_epsilon' must be a finite number > 0, got nan",
        ),
        ({"time_step_min": "small"}, r"'time_step_min' must be a finite number >= 0, got 'small'"),
        ({"time_step_min": -0.1}, r"'time_step_min' must be a finite number >= 0, got -0\.1"),
        ({"time_step_limit": [0.0]}, r"'time_step_limit' must be \[min, inf\] \(two numbers\)"),
        (
            {"time_step_limit": [0.0, "big"]},
            r"'time_step_limit' must be \[min, inf\] \(two numbers\)",
        ),
        ({"time_step_limit": 5}, r"'time_step_limit' must be \[min, inf\] \(two numbers\)"),
        (
            {"time_step_limit": [-1.0, math.inf]},
            r"'time_step_limit' must be \[min, inf\] with a finite min >= 0",
        ),
        ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, r"an upper limit is unsupported"),
        ({"time_step_limit": [0.0, "-inf"]}, r"an upper limit is unsupported"),
        ({"num_key_value_heads": 3}, r"multiple of 'num_key_value_heads'"),
        ({"n_groups": 3}, r"'mamba_num_heads' must be a multiple of 'n_groups'"),
        ({"num_hidden_layers": 3}, r"'num_hidden_layers' is 3 but the layer pattern has 8"),
        ({"time_step_limit": [0.0, 0.1]}, r"'time_step_limit' must be \[min, inf\]"),
        ({"use_conv_bias": "yes"}, r"'use_conv_bias' must be a bool"),
        (
            {"sliding_window": 4096},
            r"^config\.json: 'sliding_window' must be null \(unsupported\)$",
        ),
        (
            {"attention_bias": True},
            r"^config\.json: 'attention_bias' must be false \(Nemotron-H attention has no bias\), "
            r"got True$",
        ),
        ({"hybrid_override_pattern": "M*EE-E"}, r"has layers of kind \['E'\] at \[2, 3, 5\];"),
        (
            {"hybrid_override_pattern": "M" + "E" * 10, "num_hidden_layers": 11},
            r"has layers of kind \['E'\] at \[1, 2, 3, 4, 5, 6, 7, 8\];",
        ),
        ({"time_step_limit": ["big", math.inf]}, r"'time_step_limit' must be \[min, inf\] \(two"),
        (
            {"time_step_limit": [0.0, {"__float__": ["Infinity"]}]},
            r"'time_step_limit' must be \[min, inf\] \(two numbers\)",
        ),
    ],
)
def test_unsupported_configs_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        NemotronHConfig.from_dict(_raw(**changes))
    # read_config replaces this prefix by the file's path
    assert str(info.value).startswith("config.json: ")


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


INF_SPELLINGS = [
    pytest.param({"__float__": "Infinity"}, id="transformers-5-float-tag"),
    pytest.param(math.inf, id="python-float"),
    pytest.param("Infinity", id="string-Infinity"),
    pytest.param("inf", id="string-inf"),
    pytest.param("+INF", id="string-+INF"),
]


@pytest.mark.parametrize("upper", INF_SPELLINGS)
def test_every_infinity_spelling_of_time_step_limit_is_read(upper: object) -> None:
    cfg = NemotronHConfig.from_dict(_raw(time_step_limit=[0.0, upper]))
    assert cfg == tiny_config()


def test_as_float_reads_numbers_and_infinity_spellings_only() -> None:
    assert as_float(3) == 3.0
    assert as_float(2.5) == 2.5
    assert as_float({"__float__": "-Infinity"}) == -math.inf
    nan = as_float({"__float__": "NaN"})
    assert nan is not None and math.isnan(nan)
    for not_a_number in (True, None, "tiny", "1e-5", {"__float__": "Huge"}, [1.0], {"x": 1}):
        assert as_float(not_a_number) is None, not_a_number


@pytest.mark.parametrize(
    "text",
    [
        # what transformers 5.x save_pretrained writes
        '"time_step_limit": [0.0, {"__float__": "Infinity"}]',
        # what NVIDIA's published Nemotron-H configs carry (Python json's bare token)
        '"time_step_limit": [0.0, Infinity]',
        '"time_step_limit": [\n    0.0,\n    Infinity\n  ]',
    ],
)
def test_read_config_accepts_the_published_infinity_encodings(tmp_path: Path, text: str) -> None:
    raw = _raw()
    raw["time_step_limit"] = "PLACEHOLDER"
    body = json.dumps(raw, indent=2).replace('"time_step_limit": "PLACEHOLDER"', text)
    assert text in body
    (tmp_path / "config.json").write_text(body)
    assert read_config(tmp_path) == tiny_config()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"config\.json: the file is empty \(expected a JSON object\)"),
        (b"  \n", r"config\.json: the file is empty"),
        (
            b'{"vocab_size": 96,',
            r"config\.json: not valid JSON \(Expecting .* at line 1, column \d+\)",
        ),
        (b"\xff\xfe garbage", r"config\.json: not UTF-8 text \(byte 0\)"),
        (b"[1, 2]", r"config\.json: must hold a JSON object, got list"),
        (b'{"head_dim": "eight"}', r"config\.json: one of 'hybrid_override_pattern'"),
    ],
)
def test_read_config_names_the_file_for_unreadable_content(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        read_config(tmp_path)
    assert str(info.value).startswith(str(tmp_path / "config.json") + ": ")
    assert "\n" not in str(info.value)


def test_read_config_prefixes_the_path_once(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_raw(head_dim="eight")))
    with pytest.raises(ConfigError) as info:
        read_config(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: 'head_dim' must be a positive int, got 'eight'"
    )


# --- keys two readers resolve differently --------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param(
            {"layers_block_type": ["mamba", "attention", "mlp", "mamba", "attention", "mamba",
                                   "mlp", "attention"]},
            r"'layers_block_type' \('M\*-M\*M-\*'\) and 'hybrid_override_pattern' "
            r"\('M\*M-M\*-M'\) describe different layers",
            id="block-types-vs-pattern",
        ),
        pytest.param(
            {"layer_types": ["mamba"] * 8},
            r"'layer_types' \('MMMMMMMM'\) and 'hybrid_override_pattern'",
            id="layer-types-vs-pattern",
        ),
        pytest.param(
            {"mamba_n_groups": 4},
            r"'mamba_n_groups' 4 and 'n_groups' 2 disagree, which readers resolve differently "
            r"\(transformers reads the legacy 'mamba_n_groups'\); keep one of them",
            id="legacy-n_groups",
        ),
        pytest.param({"mamba_d_conv": 3}, r"'mamba_d_conv' 3 and 'conv_kernel' 4", id="legacy-conv"),
        pytest.param(
            {"mamba_conv_bias": False}, r"'mamba_conv_bias' False and 'use_conv_bias' True",
            id="legacy-conv-bias",
        ),
        pytest.param(
            {"mamba_dt_min": 0.01}, r"'mamba_dt_min' 0\.01 and 'time_step_min' 0\.001",
            id="legacy-dt-min",
        ),
    ],
)  # fmt: skip
def test_two_spellings_that_disagree_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NemotronHConfig.from_dict(_raw(**changes))


def test_two_spellings_that_agree_are_read() -> None:
    raw = _raw(
        layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba", "attention", "mlp",
                           "mamba"],
        layer_types=["linear_attention", "full_attention", "mamba", "mlp", "mamba", "attention",
                     "mlp", "mamba"],
        mamba_n_groups=2, mamba_chunk_size=8, mamba_conv_bias=True,
    )  # fmt: skip
    assert NemotronHConfig.from_dict(raw) == tiny_config()


def test_a_legacy_key_alone_is_read_and_named_in_refusals() -> None:
    raw = _raw()
    raw["mamba_chunk_size"] = raw.pop("chunk_size")
    assert NemotronHConfig.from_dict(raw).chunk_size == 8
    raw["mamba_chunk_size"] = "8"
    with pytest.raises(
        ConfigError, match=r"'mamba_chunk_size' \(read as 'chunk_size'\) must be a positive int"
    ):
        NemotronHConfig.from_dict(raw)
    raw = _raw()
    raw["mamba_dt_limit"] = raw.pop("time_step_limit", [0.0, 1.0])
    raw["mamba_dt_limit"] = [0.0, 1.0]
    with pytest.raises(ConfigError, match=r"'mamba_dt_limit' \(read as 'time_step_limit'\)"):
        NemotronHConfig.from_dict(raw)


def test_absent_attention_sizes_take_transformers_defaults() -> None:
    """transformers' NemotronHConfig: 32 heads, 8 KV heads, head_dim 128 (not hidden / heads)."""
    raw = _raw()
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        del raw[key]
    cfg = NemotronHConfig.from_dict(raw)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    raw["num_attention_heads"] = 4
    with pytest.raises(
        ConfigError,
        match=r"'num_attention_heads' must be a multiple of 'num_key_value_heads', got 4 and "
        r"8 \(absent: transformers' default\)",
    ):
        NemotronHConfig.from_dict(raw)
    raw["head_dim"] = None  # present but null: refused, as transformers 5 refuses it
    del raw["num_attention_heads"]
    with pytest.raises(ConfigError, match=r"'head_dim' must be a positive int, got None"):
        NemotronHConfig.from_dict(raw)


def test_attention_head_dim_is_not_read() -> None:
    raw = _raw(attention_head_dim=8)
    assert NemotronHConfig.from_dict(raw).head_dim == 8  # head_dim present: it decides
    del raw["head_dim"]
    with pytest.raises(
        ConfigError, match=r"'head_dim' is missing and 'attention_head_dim' is 8, which readers"
    ):
        NemotronHConfig.from_dict(raw)
    raw["attention_head_dim"] = 128  # agrees with transformers' default
    assert NemotronHConfig.from_dict(raw).head_dim == 128
    no_attention = _raw(hybrid_override_pattern="M-M", num_hidden_layers=3, attention_head_dim=8)
    del no_attention["head_dim"]
    assert NemotronHConfig.from_dict(no_attention).head_dim == 128  # unused: no conflict


def test_size_rules_apply_to_the_layers_that_exist() -> None:
    """Head divisibility only where the layers exist (transformers builds no other)."""
    no_attention = _raw(hybrid_override_pattern="M-M", num_hidden_layers=3,
                        num_attention_heads=3, num_key_value_heads=2)  # fmt: skip
    assert NemotronHConfig.from_dict(no_attention).pattern == "M-M"
    no_mamba = _raw(hybrid_override_pattern="*-", num_hidden_layers=2, n_groups=3)
    assert NemotronHConfig.from_dict(no_mamba).n_groups == 3
    with pytest.raises(ConfigError, match=r"'mamba_num_heads' must be a multiple of 'n_groups'"):
        NemotronHConfig.from_dict(_raw(n_groups=3))
    with pytest.raises(ConfigError, match=r"multiple of 'num_key_value_heads'"):
        NemotronHConfig.from_dict(_raw(num_key_value_heads=3))


# --- every key's type, named -----------------------------------------------------------------

FLAGS = ["use_conv_bias", "use_bias", "mlp_bias", "tie_word_embeddings", "attention_bias"]
COUNTS = [
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
    "conv_kernel", "chunk_size", "num_hidden_layers",
]  # fmt: skip
NOT_BOOLS = ["true", "false", 1, 0, None, [True], {"v": True}]
NOT_INTS = ["8", 8.0, True, False, None, [8], {"v": 8}, 2.5]


@pytest.mark.parametrize("key", FLAGS)
@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_flags_must_be_bools(key: str, value: object) -> None:
    if key == "attention_bias" and value is None:
        return  # null is transformers' "no bias"
    with pytest.raises(ConfigError, match=rf"^config\.json: '{key}' must be a(?: bool|) "):
        NemotronHConfig.from_dict(_raw(**{key: value}))


@pytest.mark.parametrize("key", COUNTS)
@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
def test_counts_must_be_ints(key: str, value: object) -> None:
    if key == "num_hidden_layers" and value is None:
        return  # transformers ignores num_hidden_layers (derived from the layer list)
    with pytest.raises(ConfigError, match=rf"^config\.json: '{key}' must be a(n int|) "):
        NemotronHConfig.from_dict(_raw(**{key: value}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers_block_type": [{"a": 1}]}, r"'layers_block_type' must be a non-empty list of"),
        ({"layers_block_type": [["mamba"]]}, r"'layers_block_type' must be a non-empty list of"),
        ({"layer_types": "mamba"}, r"'layer_types' must be a non-empty list of"),
        ({"layers_block_type": []}, r"'layers_block_type' must be a non-empty list of"),
        ({"hybrid_override_pattern": ["M"]}, r"'hybrid_override_pattern' must be a non-empty str"),
        ({"mlp_hidden_act": ["relu2"]}, r"'mlp_hidden_act' must be a str \('relu2'\), got"),
        ({"mamba_hidden_act": 1}, r"'mamba_hidden_act' must be a str \('silu'\), got 1"),
        ({"attention_bias": "false"}, r"'attention_bias' must be a bool, got 'false'"),
        (
            {"layer_norm_epsilon": True},
            r"'layer_norm_epsilon' must be a finite number > 0, got True",
        ),
        ({"time_step_min": [0.1]}, r"'time_step_min' must be a finite number >= 0, got \[0\.1\]"),
    ],
)
def test_other_keys_of_the_wrong_type_are_named(changes: dict[str, Any], message: str) -> None:
    raw = _raw(**changes)
    if "layers_block_type" in changes or "layer_types" in changes:
        del raw["hybrid_override_pattern"]
    with pytest.raises(ConfigError, match=message):
        NemotronHConfig.from_dict(raw)


def test_moe_block_types_are_named_by_their_key() -> None:
    raw = _raw(layers_block_type=["mamba", "moe"], num_hidden_layers=2)
    del raw["hybrid_override_pattern"]
    with pytest.raises(ConfigError, match=r"'layers_block_type' has layers of kind \['E'\] at"):
        NemotronHConfig.from_dict(raw)


def test_deeply_nested_json_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON \(nested too deeply\)"):
        read_config(tmp_path)


def test_a_missing_layer_list_is_named() -> None:
    raw = _raw()
    del raw["hybrid_override_pattern"]
    with pytest.raises(ConfigError) as info:
        NemotronHConfig.from_dict(raw)
    assert str(info.value) == (
        "config.json: one of 'hybrid_override_pattern' or 'layers_block_type' is required"
    )


def test_disagreeing_layer_lists_name_each_reader_and_the_remedy() -> None:
    raw = _raw(layer_types=["mamba"] * 8)
    with pytest.raises(ConfigError) as info:
        NemotronHConfig.from_dict(raw)
    assert str(info.value) == (
        "config.json: 'layer_types' ('MMMMMMMM') and 'hybrid_override_pattern' ('M*M-M*-M') "
        "describe different layers, which readers resolve differently (transformers 5 reads "
        "'layer_types', transformers 4 and NVIDIA's modelling code 'hybrid_override_pattern'); "
        "make them agree or keep one"
    )


# --- the smallest and largest values, and the defaults of absent keys ------------------------


def test_the_smallest_and_largest_sizes_are_accepted() -> None:
    """1 is a valid count (one KV head, one group, one layer), 2 a valid conv width, and
    2**31 - 1 the largest size."""
    cfg = NemotronHConfig.from_dict(
        _raw(num_key_value_heads=1, n_groups=1, conv_kernel=2, vocab_size=MAX_SIZE, chunk_size=1)
    )
    assert (cfg.num_key_value_heads, cfg.n_groups, cfg.conv_kernel) == (1, 1, 2)
    assert (cfg.vocab_size, cfg.chunk_size) == (MAX_SIZE, 1)
    one_layer = NemotronHConfig.from_dict(_raw(hybrid_override_pattern="M", num_hidden_layers=1))
    assert one_layer.pattern == "M"
    # transformers clamps dt to [time_step_min, inf]: a floor of 0 (no clamp) is a valid model
    no_floor = attrs.evolve(tiny_config(), time_step_min=0.0)
    assert NemotronHConfig.from_dict(_raw(time_step_min=0)) == no_floor
    assert NemotronHConfig.from_dict(_raw(time_step_min=0.0, time_step_limit=[0, math.inf])) == (
        no_floor
    )


#: transformers' NemotronHConfig defaults of the keys the runtime reads with a default
HF_OPTIONAL_DEFAULTS: dict[str, object] = {
    "layer_norm_epsilon": 1e-5,
    "time_step_min": 0.001,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}


def test_absent_optional_keys_take_transformers_defaults() -> None:
    """Each optional key absent (with the others set away from their defaults) reads as
    transformers reads it; absent activations, attention bias and sliding window are
    the supported ones."""
    opposite = {
        "layer_norm_epsilon": 1e-6,
        "time_step_min": 0.01,
        "use_conv_bias": False,
        "use_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    }
    for key, default in HF_OPTIONAL_DEFAULTS.items():
        raw = _raw(**opposite)
        del raw[key]
        cfg = NemotronHConfig.from_dict(raw)
        assert getattr(cfg, key) == default, key
        for other, value in opposite.items():
            if other != key:
                assert getattr(cfg, other) == value, (key, other)
    raw = _raw()
    for key in ("mlp_hidden_act", "mamba_hidden_act", "attention_bias", "model_type"):
        del raw[key]
    raw["sliding_window"] = None
    assert NemotronHConfig.from_dict(raw) == tiny_config()


def test_a_refusal_marks_each_absent_attention_size_as_transformers_default() -> None:
    raw = _raw(num_key_value_heads=5)
    del raw["num_attention_heads"]
    with pytest.raises(ConfigError) as info:
        NemotronHConfig.from_dict(raw)
    assert str(info.value).endswith("got 32 (absent: transformers' default) and 5")


# --- to_hf_dict: the config.json an engine or transformers reads --------------------------------

#: keys whose value does not depend on the configuration: the model class transformers and
#: vLLM pick by (``architectures``, ``model_type``), what the runtime implements, and
#: transformers' NemotronHConfig defaults of the special token ids
HF_FIXED: dict[str, object] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "attention_bias": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _unusual_config() -> NemotronHConfig:
    """Every flag and float away from its default, so a key lost on the way reads back wrong."""
    return NemotronHConfig.from_dict(
        _raw(layer_norm_epsilon=1e-6, time_step_min=0.02, use_conv_bias=False, use_bias=True,
             mlp_bias=True, tie_word_embeddings=True)
    )  # fmt: skip


def test_hf_dict_round_trips_every_field_away_from_its_default() -> None:
    cfg = _unusual_config()
    assert NemotronHConfig.from_dict(cfg.to_hf_dict()) == cfg
    assert {k: v for k, v in cfg.to_hf_dict().items() if k in HF_OPTIONAL_DEFAULTS} == {
        key: getattr(cfg, key) for key in HF_OPTIONAL_DEFAULTS
    }


def test_hf_dict_names_the_model_class_and_the_supported_kinds() -> None:
    hf = tiny_config().to_hf_dict()
    assert {key: hf.get(key) for key in HF_FIXED} == HF_FIXED


def test_hf_dict_declares_the_dtype_of_the_weights_written(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    weights = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {getattr(torch, raw["torch_dtype"])}


def test_hf_dict_is_read_by_transformers_as_the_runtime_reads_it() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = _unusual_config()
    hf = transformers.NemotronHConfig(**cfg.to_hf_dict())
    assert hf.hybrid_override_pattern == cfg.pattern
    for field in attrs.fields(NemotronHConfig):
        if field.name != "pattern":
            assert getattr(hf, field.name) == getattr(cfg, field.name), field.name
    assert hf.architectures == HF_FIXED["architectures"]
    assert transformers.AutoConfig.for_model(HF_FIXED["model_type"]).__class__ is type(hf)
    default = transformers.NemotronHConfig()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(default, key) == HF_FIXED[key], key
    for key, value in HF_OPTIONAL_DEFAULTS.items():
        assert getattr(default, key) == value, key
    assert (default.mlp_hidden_act, default.mamba_hidden_act) == ("relu2", "silu")
    assert str(hf.dtype).removeprefix("torch.") == cfg.to_hf_dict()["torch_dtype"]


# --- reading a file ----------------------------------------------------------------------------


def test_read_json_decodes_the_transformers_float_tags_only(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text(
        '{"inf": {"__float__": "Infinity"}, "neg": [{"__float__": "-Infinity"}],'
        ' "unknown": {"__float__": "Huge"}, "extra": {"__float__": "NaN", "x": 1},'
        ' "not_str": {"__float__": 1}}'
    )
    got = read_json(path, ConfigError)
    assert got["inf"] == math.inf and got["neg"] == [-math.inf]
    assert got["unknown"] == {"__float__": "Huge"}
    assert got["extra"] == {"__float__": "NaN", "x": 1}
    assert got["not_str"] == {"__float__": 1}


def test_read_config_names_a_dangling_link_as_one(tmp_path: Path) -> None:
    """The Hugging Face cache links config.json to a blob: a lost blob is not an absent file."""
    (tmp_path / "config.json").symlink_to(tmp_path / "blobs" / "0123")
    with pytest.raises(ConfigError) as info:
        read_config(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'}: missing (a dangling symbolic link?)"


def test_read_config_refuses_a_directory_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError) as info:
        read_config(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: is a directory, not a regular file; "
        "only regular files are read"
    )


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _symlink(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda d: _fifo(d / "fifo"), "is a FIFO, not a regular file; only regular files are read"),
        (lambda d: Path("/dev/null"), "is a character device, not a regular file; only regular "
                                      "files are read"),
        (lambda d: _symlink(d / "dangling", "nowhere"), "missing (a dangling symbolic link?)"),
        (lambda d: _symlink(d / "loop", "loop"), "cannot be read (Too many levels of symbolic "
                                                 "links)"),
    ],
    ids=["fifo", "char-device", "dangling-link", "link-loop"],
)  # fmt: skip
def test_check_regular_file_names_what_the_path_is(
    tmp_path: Path, make: Callable[[Path], Path], what: str
) -> None:
    path = make(tmp_path)
    if not path.exists() and not path.is_symlink():
        pytest.skip(f"{path} is not on this system")
    with pytest.raises(ConfigError) as info:
        check_regular_file(path, ConfigError)
    assert str(info.value) == f"{path}: {what}"
    with pytest.raises(ConfigError) as info:
        read_json(path, ConfigError)
    assert str(info.value) == f"{path}: {what}"


def test_read_json_names_a_file_that_fails_to_read() -> None:
    """A regular file whose read fails (Linux's ``/proc/self/mem`` at offset 0: EIO)."""
    path = Path("/proc/self/mem")
    if not path.exists():
        pytest.skip("no /proc/self/mem")
    with pytest.raises(ConfigError) as info:
        read_json(path, ConfigError)
    assert str(info.value) == f"{path}: cannot be read (Input/output error)"
