"""Load a Hugging Face Nemotron-H checkpoint directory (``config.json`` + safetensors).

Accepted layouts: one ``model.safetensors``, a sharded set with
``model.safetensors.index.json``, or any ``*.safetensors`` files in the directory.
Parameter names may carry the ``backbone.`` prefix of NVIDIA's checkpoints (and of
``transformers``' ``save_pretrained``) or the ``model.`` prefix; ``mtp.*`` (multi-token
prediction) weights are ignored, as ``transformers`` ignores them.

Loading runs in two passes. The first reads only the safetensors headers and refuses
missing, unexpected, mis-shaped and non-floating-point tensors before any weight is read.
The second streams: one tensor at a time is read, converted to the target dtype, placed on
the target device and checked for NaN/inf, so host memory never holds a second copy of
the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open

from hybridmeta.runtime.config import ConfigError, NemotronHConfig, read_config, read_json
from hybridmeta.runtime.model import NemotronH

__all__ = ["CheckpointError", "checkpoint_files", "load_nemotron_h", "runtime_name"]

_PREFIXES = ("backbone.", "model.")
_IGNORED_PREFIXES = ("mtp.",)
_ALIASES = {"embedding.weight": "embeddings.weight"}
#: safetensors dtype names of the weights the runtime accepts (quantised F8 needs scales)
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class CheckpointError(ValueError):
    """A checkpoint directory whose files or tensors the runtime cannot load."""


def runtime_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the runtime's parameter name (``None``: ignored)."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return _ALIASES.get(name, name)


def _index_files(index: Path, model_dir: Path) -> dict[Path, set[str]]:
    """Shard file -> tensor names, from ``model.safetensors.index.json``."""
    raw = read_json(index, CheckpointError)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) and v for v in weight_map.values())
    ):
        raise CheckpointError(
            f"{index}: 'weight_map' must be a non-empty object mapping tensor names to "
            "shard file names"
        )
    files: dict[Path, set[str]] = {}
    for name, fname in weight_map.items():
        files.setdefault(model_dir / fname, set()).add(name)
    missing = sorted(str(p) for p in files if not p.is_file())
    if missing:
        raise CheckpointError(f"{index}: listed shard files are missing: {missing}")
    return dict(sorted(files.items()))


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(_index_files(index, model_dir))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files in the model directory")
    return files


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open`` with a corrupt or truncated file reported as :class:`CheckpointError`."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path}: not a valid safetensors file (truncated or corrupt: {err})"
        ) from None
    with handle as f:
        yield f


@attrs.frozen(kw_only=True)
class _Entry:
    """One tensor of the checkpoint, known from its file's header only."""

    path: Path
    name: str  # as stored
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name ("F32", "BF16", ...)


def _scan(model_dir: Path) -> dict[str, _Entry]:
    """Runtime name -> header entry, over every file; reads no tensor data."""
    index = model_dir / "model.safetensors.index.json"
    listed = _index_files(index, model_dir) if index.is_file() else None
    files = list(listed) if listed is not None else checkpoint_files(model_dir)
    entries: dict[str, _Entry] = {}
    for path in files:
        with _open(path) as f:
            names = list(f.keys())
            for name in names:
                key = runtime_name(name)
                if key is None:
                    continue
                if key in entries:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} maps to {key!r}, which "
                        f"{entries[key].path.name} already holds as {entries[key].name!r}"
                    )
                meta = f.get_slice(name)
                entries[key] = _Entry(
                    path=path, name=name, shape=tuple(meta.get_shape()), dtype=meta.get_dtype()
                )
        if listed is not None:
            absent = sorted(listed[path] - set(names))
            if absent:
                raise CheckpointError(
                    f"{index}: 'weight_map' puts {absent[:4]} in {path.name}, "
                    "which does not hold them"
                )
    return entries


def load_nemotron_h(
    model_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> NemotronH:
    """Load a Nemotron-H checkpoint into a :class:`~hybridmeta.runtime.model.NemotronH`.

    Weights stream from the files to ``device`` one tensor at a time (read, convert,
    place, check), so host memory holds at most one tensor beyond the model itself.

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
        A file is unreadable (corrupt JSON index, truncated or garbage safetensors), or a
        tensor is missing, unexpected, mis-shaped, not floating point, or holds NaN/inf.
        Every message names the file and, where there is one, the tensor.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ConfigError(f"{root}: model directory does not exist")
    config: NemotronHConfig = read_config(root)
    entries = _scan(root)
    with torch.device("meta"):
        model = NemotronH(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        entries.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(entries))
    unexpected = sorted(set(entries) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{root}: checkpoint does not match config.json "
            f"(missing {len(missing)}: {missing[:6]}; unexpected {len(unexpected)}: {unexpected[:6]})"
        )
    wrong = [
        f"{k}: {e.shape} != {expected[k]}" for k, e in entries.items() if e.shape != expected[k]
    ]
    if wrong:
        raise CheckpointError(f"{root}: tensors with the wrong shape: {wrong[:6]}")
    for e in entries.values():
        if e.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{e.path}: tensor {e.name!r} has dtype {e.dtype}; weights must be floating "
                f"point ({', '.join(_FLOAT_DTYPES)})"
            )
    state = _stream(entries, torch.device(device), dtype)
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model.eval()
    model.requires_grad_(False)
    return model


def _stream(
    entries: dict[str, _Entry], device: torch.device, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """Read, convert, place and check one tensor at a time, one file open at a time."""
    by_file: dict[Path, list[tuple[str, _Entry]]] = {}
    for key, e in entries.items():
        by_file.setdefault(e.path, []).append((key, e))
    state: dict[str, torch.Tensor] = {}
    for path, items in by_file.items():
        with _open(path) as f:
            for key, e in items:
                raw = f.get_tensor(e.name)
                placed = raw.to(device=device, dtype=dtype if dtype is not None else raw.dtype)
                if not bool(torch.isfinite(placed).all()):
                    where = (
                        "holds NaN or inf values"
                        if not bool(torch.isfinite(raw).all())
                        else f"overflows to inf when converted to {dtype}"
                    )
                    raise CheckpointError(f"{path}: tensor {e.name!r} {where}")
                del raw  # the host copy goes before the next tensor is read
                state[key] = placed
    return state
