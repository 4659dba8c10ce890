"""config.json parsing: supported layouts accepted, unsupported ones refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from hybridmeta.runtime.config import ConfigError, NemotronHConfig, as_float, read_config
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
        ({"layer_norm_epsilon": True}, r"'layer_norm_epsilon' must be a finite number > 0, got True"),
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
