"""Load a Hugging Face Nemotron-H checkpoint directory (``config.json`` + safetensors).

Accepted layouts: one ``model.safetensors``, a sharded set with
``model.safetensors.index.json``, or any ``*.safetensors`` files in the directory.
Parameter names may carry the ``backbone.`` prefix of NVIDIA's checkpoints or the
``model.`` prefix of ``transformers``; ``mtp.*`` (multi-token prediction) weights are
ignored, as ``transformers`` ignores them. Missing, unexpected and mis-shaped tensors are
refused with a message that names them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from hybridmeta.runtime.config import ConfigError, NemotronHConfig, read_config
from hybridmeta.runtime.model import NemotronH

__all__ = ["CheckpointError", "checkpoint_files", "load_nemotron_h", "runtime_name"]

_PREFIXES = ("backbone.", "model.")
_IGNORED_PREFIXES = ("mtp.",)
_ALIASES = {"embedding.weight": "embeddings.weight"}


class CheckpointError(ValueError):
    """A checkpoint directory whose tensors do not fit its configuration."""


def runtime_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the runtime's parameter name (``None``: ignored)."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return _ALIASES.get(name, name)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with index.open() as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object")
        files = sorted({model_dir / str(v) for v in weight_map.values()})
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index}: listed shard files are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files in the model directory")
    return files


def _read_tensors(files: Iterable[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                key = runtime_name(name)
                if key is None:
                    continue
                if key in out:
                    raise CheckpointError(f"{path}: tensor {name!r} maps to {key!r} twice")
                out[key] = f.get_tensor(name)
    return out


def load_nemotron_h(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> NemotronH:
    """Load a Nemotron-H checkpoint into a :class:`~hybridmeta.runtime.model.NemotronH`.

    Parameters
    ----------
    model_dir
        Directory holding ``config.json`` and safetensors weights.
    device
        Where the weights go.
    dtype
        Weight dtype; ``None`` keeps the checkpoint's floating dtype.

    Raises
    ------
    ConfigError
        ``config.json`` is missing, malformed or asks for unsupported layers (e.g. MoE).
    CheckpointError
        Tensors are missing, unexpected, or have the wrong shape.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: model directory does not exist")
    config: NemotronHConfig = read_config(root)
    tensors = _read_tensors(checkpoint_files(root))
    with torch.device("meta"):
        model = NemotronH(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{root}: checkpoint does not match config.json "
            f"(missing {len(missing)}: {missing[:6]}; unexpected {len(unexpected)}: {unexpected[:6]})"
        )
    wrong = [
        f"{k}: {tuple(tensors[k].shape)} != {tuple(shape)}"
        for k, shape in expected.items()
        if tuple(tensors[k].shape) != tuple(shape)
    ]
    if wrong:
        raise CheckpointError(f"{root}: tensors with the wrong shape: {wrong[:6]}")
    target = torch.device(device)
    state = {
        k: t.to(
            device=target, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype
        )
        for k, t in tensors.items()
    }
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model.eval()
    model.requires_grad_(False)
    return model
