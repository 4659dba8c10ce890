"""Nemotron-H model configuration as read from a Hugging Face ``config.json``.

Only what the reference runtime supports is accepted: Mamba2 mixer (``M``), attention
(``*``) and MLP (``-``) layers. Anything else (MoE ``E`` layers, other activations,
biases the reference implementation ignores) is refused with a message naming the key, as
is every key of the wrong type (bools for flags, ints for counts). Keys are read as
``transformers`` (5.19 to 5.24) reads them: its precedence among the layer lists, its
legacy names, its defaults of the attention sizes; where two spellings of one setting
disagree (readers resolve them differently) the file is refused, naming both.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "LAYER_KINDS",
    "MAX_SIZE",
    "ConfigError",
    "NemotronHConfig",
    "as_float",
    "check_regular_file",
    "read_config",
    "read_json",
]

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

# Keys renamed over the model's history (legacy name -> current name), as transformers
# (5.19 to 5.24) maps them: where both are present it reads the legacy one, so two that
# disagree are refused. transformers does not read ``attention_head_dim``.
_LEGACY_KEYS: dict[str, str] = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_limit": "time_step_limit",
}

#: transformers' defaults of the attention sizes (its ``NemotronHConfig``), taken when a key
#: is absent; for ``head_dim`` it does not derive ``hidden_size // num_attention_heads``.
_HF_DEFAULTS: dict[str, int] = {
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


#: Upper bound of every size in ``config.json``: products of sizes index int64 tensors, and
#: a size past int32 is a corrupt file, not a model.
MAX_SIZE = 2**31 - 1

#: How ``transformers`` (5.x) writes floats that JSON has no literal for
#: (``"time_step_limit": [0.0, {"__float__": "Infinity"}]``).
_FLOAT_TAGS: dict[str, float] = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
#: Strings some writers use for infinity where a number belongs.
_INF_STRINGS: dict[str, float] = {
    "inf": math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
}


class ConfigError(ValueError):
    """A ``config.json`` the runtime cannot serve; the message names the key and the rule."""


def as_float(value: object) -> float | None:
    """A ``config.json`` number as a float, or ``None`` when it is not a number.

    Accepts JSON numbers, the non-standard ``Infinity`` / ``-Infinity`` / ``NaN`` tokens
    Python's ``json`` writes (NVIDIA's published configs carry ``[0.0, Infinity]``),
    ``transformers`` 5.x's ``{"__float__": "Infinity"}`` objects and the strings
    ``"inf"`` / ``"Infinity"`` (any case, optional sign). Booleans are not numbers.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        tag = value["__float__"]
        return _FLOAT_TAGS.get(tag) if isinstance(tag, str) else None
    if isinstance(value, str):
        return _INF_STRINGS.get(value.strip().lower())
    return None


def _decode_float_tags(obj: dict[str, Any]) -> Any:
    """``json`` object hook: ``{"__float__": "Infinity"}`` -> ``inf`` (as ``transformers`` reads it)."""
    if set(obj) == {"__float__"} and isinstance(obj["__float__"], str):
        tag = obj["__float__"]
        if tag in _FLOAT_TAGS:
            return _FLOAT_TAGS[tag]
    return obj


def _check_time_step_limit(limit: object, key: str = "'time_step_limit'") -> None:
    """``time_step_limit`` is ``[min, inf]``: dt has no upper clamp (as in ``transformers``)."""
    if limit is None:
        return
    values = (
        [as_float(v) for v in limit] if isinstance(limit, list | tuple) and len(limit) == 2 else []
    )
    if len(values) != 2 or values[0] is None or values[1] is None:
        raise ConfigError(f"config.json: {key} must be [min, inf] (two numbers), got {limit!r}")
    if not math.isfinite(values[0]) or values[0] < 0:
        raise ConfigError(
            f"config.json: {key} must be [min, inf] with a finite min >= 0, got {limit!r}"
        )
    if values[1] != math.inf:
        raise ConfigError(
            f"config.json: {key} must be [min, inf] (an upper limit is unsupported), got {limit!r}"
        )


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
        legacy: dict[str, str] = {}  # current name -> the legacy name the value came from
        for old, new in _LEGACY_KEYS.items():
            if cfg.get(old) is None:
                continue
            if cfg.get(new) is not None and cfg[new] != cfg[old]:
                raise ConfigError(
                    f"config.json: {old!r} {cfg[old]!r} and {new!r} {cfg[new]!r} disagree, "
                    f"which readers resolve differently (transformers reads the legacy "
                    f"{old!r}); keep one of them"
                )
            cfg[new] = cfg[old]
            legacy[new] = old

        def name(key: str) -> str:
            """The key as the file spells it (a legacy name where the value came from one)."""
            return f"{legacy[key]!r} (read as {key!r})" if key in legacy else repr(key)

        model_type = cfg.get("model_type")
        if model_type is not None and model_type != "nemotron_h":
            raise ConfigError(f"config.json: model_type must be 'nemotron_h', got {model_type!r}")
        pattern = _read_pattern(cfg)

        def need_int(key: str, default: int | None = None, minimum: int = 1) -> int:
            if key not in cfg and default is None:
                raise ConfigError(f"config.json: required key {key!r} is missing")
            value = cfg.get(key, default)
            rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"config.json: {name(key)} must be {rule}, got {value!r}")
            if value > MAX_SIZE:
                raise ConfigError(
                    f"config.json: {name(key)} must be {rule} <= 2**31 - 1, got {value!r}"
                )
            return value

        def need_float(key: str, default: float, *, positive: bool) -> float:
            raw_value = cfg.get(key, default)
            value = as_float(raw_value)
            if value is None or not math.isfinite(value) or value < 0 or (positive and value == 0):
                rule = "> 0" if positive else ">= 0"
                raise ConfigError(
                    f"config.json: {name(key)} must be a finite number {rule}, got {raw_value!r}"
                )
            return value

        def need_bool(key: str, default: bool) -> bool:
            value = cfg.get(key, default)
            if not isinstance(value, bool):
                raise ConfigError(f"config.json: {name(key)} must be a bool, got {value!r}")
            return value

        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            got = cfg.get(key, want)
            if not isinstance(got, str):
                raise ConfigError(f"config.json: {key!r} must be a str ({want!r}), got {got!r}")
            if got != want:
                raise ConfigError(f"config.json: {key!r} must be {want!r} (unsupported: {got!r})")
        bias = cfg.get("attention_bias")
        if bias is not None and not isinstance(bias, bool):
            raise ConfigError(f"config.json: 'attention_bias' must be a bool, got {bias!r}")
        if bias:
            raise ConfigError(
                "config.json: 'attention_bias' must be false (Nemotron-H attention has no bias), "
                f"got {bias!r}"
            )
        if cfg.get("sliding_window") is not None:
            raise ConfigError("config.json: 'sliding_window' must be null (unsupported)")

        # The attention sizes: an absent key takes transformers' default, as transformers does.
        absent = {key for key in _HF_DEFAULTS if key not in cfg}
        heads = need_int("num_attention_heads", _HF_DEFAULTS["num_attention_heads"])
        kv_heads = need_int("num_key_value_heads", _HF_DEFAULTS["num_key_value_heads"])
        head_dim = need_int("head_dim", _HF_DEFAULTS["head_dim"])
        legacy_dim = cfg.get("attention_head_dim")
        if "head_dim" in absent and "*" in pattern and legacy_dim not in (None, head_dim):
            raise ConfigError(
                f"config.json: 'head_dim' is missing and 'attention_head_dim' is {legacy_dim!r}, "
                f"which readers resolve differently (transformers ignores 'attention_head_dim' "
                f"and takes its default head_dim {head_dim}); set 'head_dim'"
            )

        def shown(key: str, value: int) -> str:
            return f"{value} (absent: transformers' default)" if key in absent else str(value)

        t_min = need_float("time_step_min", 0.001, positive=False)
        _check_time_step_limit(cfg.get("time_step_limit"), name("time_step_limit"))

        config = cls(
            vocab_size=need_int("vocab_size"),
            hidden_size=need_int("hidden_size"),
            pattern=pattern,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=need_int("intermediate_size"),
            mamba_num_heads=need_int("mamba_num_heads"),
            mamba_head_dim=need_int("mamba_head_dim"),
            ssm_state_size=need_int("ssm_state_size"),
            n_groups=need_int("n_groups"),
            # a causal conv of width 1 keeps no state between steps: the decode path needs >= 2
            conv_kernel=need_int("conv_kernel", minimum=2),
            chunk_size=need_int("chunk_size"),
            layer_norm_epsilon=need_float("layer_norm_epsilon", 1e-5, positive=True),
            use_conv_bias=need_bool("use_conv_bias", True),
            use_bias=need_bool("use_bias", False),
            mlp_bias=need_bool("mlp_bias", False),
            time_step_min=t_min,
            tie_word_embeddings=need_bool("tie_word_embeddings", False),
        )
        if config.attention_layers and heads % kv_heads:
            raise ConfigError(
                "config.json: 'num_attention_heads' must be a multiple of 'num_key_value_heads', "
                f"got {shown('num_attention_heads', heads)} and "
                f"{shown('num_key_value_heads', kv_heads)}"
            )
        if config.mamba_layers and config.mamba_num_heads % config.n_groups:
            raise ConfigError(
                "config.json: 'mamba_num_heads' must be a multiple of 'n_groups', "
                f"got {config.mamba_num_heads} and {config.n_groups}"
            )
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


def _block_types_pattern(key: str, types: object) -> str:
    """A ``layers_block_type`` / ``layer_types`` list as a pattern string."""
    if (
        not isinstance(types, list)
        or not types
        or any(not isinstance(t, str) or t not in _BLOCK_TYPES for t in types)
    ):
        raise ConfigError(
            f"config.json: {key!r} must be a non-empty list of {sorted(_BLOCK_TYPES)}, "
            f"got {types!r}"
        )
    return "".join(_BLOCK_TYPES[t] for t in types)


def _read_pattern(cfg: Mapping[str, Any]) -> str:
    """The layer pattern from ``layer_types``, ``layers_block_type`` or ``hybrid_override_pattern``.

    transformers (5.19 to 5.24) reads them in that order of precedence and ignores the
    others; transformers 4 and NVIDIA's modelling code read ``hybrid_override_pattern``.
    Two of them that describe different layers are refused.
    """
    spelled: dict[str, str] = {}
    for key in ("layer_types", "layers_block_type"):
        if cfg.get(key) is not None:
            spelled[key] = _block_types_pattern(key, cfg[key])
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"config.json: 'hybrid_override_pattern' must be a non-empty str, got {pattern!r}"
            )
        spelled["hybrid_override_pattern"] = pattern
    if not spelled:
        raise ConfigError(
            "config.json: one of 'hybrid_override_pattern' or 'layers_block_type' is required"
        )
    (first, raw), *others = spelled.items()
    for key, other in others:
        if other != raw:
            raise ConfigError(
                f"config.json: {first!r} ({raw!r}) and {key!r} ({other!r}) describe different "
                f"layers, which readers resolve differently (transformers 5 reads {first!r}, "
                "transformers 4 and NVIDIA's modelling code 'hybrid_override_pattern'); make "
                "them agree or keep one"
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
            f"config.json: {first!r} has layers of kind {unsupported} at "
            f"{where[:8]}; the reference runtime supports only M (Mamba2), * (attention) and "
            f"- (MLP) layers (MoE 'E' layers are not supported)"
        )
    num = cfg.get("num_hidden_layers")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise ConfigError(f"config.json: 'num_hidden_layers' must be a positive int, got {num!r}")
    # transformers ignores a stale num_hidden_layers next to an explicit layers_block_type
    if num is not None and num != len(raw) and first == "hybrid_override_pattern":
        raise ConfigError(
            f"config.json: 'num_hidden_layers' is {num} but the layer pattern has {len(raw)} layers"
        )
    return raw


def read_config(model_dir: str | Path) -> NemotronHConfig:
    """Read and validate ``model_dir/config.json``.

    Raises
    ------
    ConfigError
        The file is missing, unreadable, not JSON, or fails :meth:`NemotronHConfig.from_dict`;
        the message starts with the file's path.
    """
    path = Path(model_dir) / "config.json"
    if not path.exists() and not path.is_symlink():  # a dangling link is named as one below
        raise ConfigError(f"{path}: no config.json in the model directory")
    raw = read_json(path, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    try:
        return NemotronHConfig.from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {str(err).removeprefix('config.json: ')}") from None


def read_json(path: Path, error: type[ValueError]) -> Any:
    """Parse a JSON file of a checkpoint; every failure is ``error`` naming the file.

    ``{"__float__": ...}`` objects are decoded as ``transformers`` writes them; the bare
    ``Infinity`` / ``NaN`` tokens Python's ``json`` writes are accepted.
    """
    check_regular_file(path, error)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    if not text.strip():
        raise error(f"{path}: the file is empty (expected a JSON object)")
    try:
        return json.loads(text, object_hook=_decode_float_tags)
    except json.JSONDecodeError as err:
        raise error(
            f"{path}: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})"
        ) from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_regular_file(path: Path, error: type[ValueError]) -> None:
    """Refuse ``path`` unless it is a regular file (or a symbolic link to one).

    Checked before a file is opened: opening a FIFO blocks until a writer appears, and a
    device reads forever. The error names the file and what it is.
    """
    try:
        mode = os.stat(path).st_mode  # follows symbolic links (the Hugging Face cache's)
    except FileNotFoundError:
        raise error(f"{path}: missing (a dangling symbolic link?)") from None
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")
        raise error(f"{path}: is {kind}, not a regular file; only regular files are read")
