"""Load a Hugging Face Nemotron-H checkpoint directory (``config.json`` + safetensors).

Which files hold the weights is decided as ``transformers`` (5.19 to 5.24) decides it,
and a directory that two readers would read differently is refused, naming the conflict:

1. ``config.json``'s ``transformers_weights`` names the file (a ``.safetensors`` or a
   ``.safetensors.index.json`` inside the directory): that file alone, as ``transformers``.
2. ``model.safetensors`` beside ``model.safetensors.index.json`` is refused:
   ``transformers`` loads the single file, vLLM and sglang the index's shards.
3. ``model.safetensors``: that file. Other ``*.safetensors`` files beside it without an
   index are refused (``transformers`` reads the single file, a glob reader all of them).
4. ``model.safetensors.index.json``: the shards its ``weight_map`` lists. Entries must be
   relative paths inside the directory (no absolute paths, no ``..`` escaping it).
5. Otherwise every ``*.safetensors`` file of the directory (``transformers`` loads no
   such directory; the main job then reports its comparison as skipped).

Only regular files are opened (symbolic links to regular files are followed, as in the
Hugging Face cache): a FIFO, a device or a directory named ``*.safetensors`` is refused
before anything is opened. Parameter names may carry the ``backbone.`` prefix of NVIDIA's
checkpoints (and of ``transformers``' ``save_pretrained``) or the ``model.`` prefix;
``mtp.*`` (multi-token prediction) weights are ignored, as ``transformers`` ignores them.
With ``tie_word_embeddings: true`` the output head is the embedding matrix; a stored
``lm_head.weight`` must then equal it (``transformers``' NemotronH ignores the flag and
uses a stored head, vLLM and sglang the embeddings: a head that differs is refused).

Loading runs in two passes. The first reads only the safetensors headers and refuses
missing, unexpected, mis-shaped and non-floating-point tensors before any weight is read.
The second streams: one tensor at a time is read, converted to the target dtype, placed on
the target device and checked for NaN/inf, so host memory never holds a second copy of
the model.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import SafetensorError, safe_open

from hybridmeta.runtime.config import (
    ConfigError,
    NemotronHConfig,
    check_regular_file,
    read_config,
    read_json,
)
from hybridmeta.runtime.model import NemotronH

__all__ = [
    "INDEX_NAME",
    "SINGLE_NAME",
    "CheckpointError",
    "checkpoint_files",
    "load_nemotron_h",
    "runtime_name",
]

#: The file names ``transformers`` looks for (``SAFE_WEIGHTS_NAME``, ``SAFE_WEIGHTS_INDEX_NAME``).
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_PREFIXES = ("backbone.", "model.")
_IGNORED_PREFIXES = ("mtp.",)
_HEAD = "lm_head.weight"
_EMBEDDINGS = "embeddings.weight"
#: safetensors dtype names of the weights the runtime accepts (quantised F8 needs scales)
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class CheckpointError(ValueError):
    """A checkpoint directory whose files or tensors the runtime cannot load."""


def runtime_name(name: str) -> str | None:
    """Map a checkpoint tensor name to the runtime's parameter name (``None``: ignored).

    The ``backbone.`` and ``model.`` prefixes are dropped, as ``transformers`` renames
    ``backbone.`` to ``model.``; no other name is rewritten (``transformers`` rewrites none).
    """
    if name.startswith(_IGNORED_PREFIXES):
        return None
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _inside(model_dir: Path, name: str, where: str) -> Path:
    """``model_dir / name`` for a relative file name that stays inside ``model_dir``.

    The check is on the name (``..`` components, absolute paths), not on where symbolic
    links lead: the Hugging Face cache links every file of a snapshot to a blob outside it.
    """
    norm = posixpath.normpath(name.replace(os.sep, "/"))
    if posixpath.isabs(norm) or norm == ".." or norm.startswith("../") or norm == ".":
        raise CheckpointError(
            f"{where} names {name!r}, which is not a file inside the model directory "
            f"{model_dir} (absolute paths and '..' are refused)"
        )
    return model_dir / norm


def _regular(path: Path) -> None:
    check_regular_file(path, CheckpointError)


def _index_files(index: Path, model_dir: Path) -> dict[Path, set[str]]:
    """Shard file -> tensor names, from a ``*.safetensors.index.json``."""
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
        path = _inside(model_dir, fname, f"{index}: 'weight_map' entry {name!r}")
        files.setdefault(path, set()).add(name)
    missing = sorted(str(p) for p in files if not p.exists())
    if missing:
        raise CheckpointError(f"{index}: listed shard files are missing: {missing}")
    for path in sorted(files):
        _regular(path)
    return dict(sorted(files.items()))


@attrs.frozen(kw_only=True)
class _Layout:
    """The weight files of a directory; ``index``/``listed``: the index and its map."""

    files: list[Path]
    index: Path | None = None
    listed: dict[Path, set[str]] | None = None


def _explicit_weights(model_dir: Path) -> str | None:
    """``config.json``'s ``transformers_weights`` (the file ``transformers`` loads), if set."""
    path = model_dir / "config.json"
    raw = read_json(path, ConfigError)
    value = raw.get("transformers_weights") if isinstance(raw, dict) else None
    if value is None:
        return None
    if not isinstance(value, str) or not value.endswith(
        (".safetensors", ".safetensors.index.json")
    ):
        raise ConfigError(
            f"{path}: 'transformers_weights' must name a *.safetensors or "
            f"*.safetensors.index.json file in the model directory, got {value!r}"
        )
    return value


def _layout(model_dir: Path) -> _Layout:
    explicit = _explicit_weights(model_dir)
    if explicit is not None:
        path = _inside(model_dir, explicit, f"{model_dir / 'config.json'}: 'transformers_weights'")
        if not path.exists():
            raise CheckpointError(
                f"{path}: missing ({model_dir / 'config.json'}: 'transformers_weights' names it)"
            )
        _regular(path)
        if explicit.endswith(".index.json"):
            listed = _index_files(path, model_dir)
            return _Layout(files=list(listed), index=path, listed=listed)
        return _Layout(files=[path])
    single, index = model_dir / SINGLE_NAME, model_dir / INDEX_NAME
    if single.exists() and index.exists():
        raise CheckpointError(
            f"{model_dir}: holds both {SINGLE_NAME} and {INDEX_NAME}, which readers load "
            f"differently (transformers: {SINGLE_NAME} alone; vLLM, sglang: the shards of "
            "the index); remove the stale one"
        )
    if single.exists():
        _regular(single)
        others = sorted(p.name for p in model_dir.glob("*.safetensors") if p != single)
        if others:
            raise CheckpointError(
                f"{model_dir}: holds {SINGLE_NAME} and other *.safetensors files "
                f"{others[:4]} without an index, which readers load differently "
                f"(transformers: {SINGLE_NAME} alone; vLLM, sglang: every *.safetensors); "
                f"remove the others or add {INDEX_NAME}"
            )
        return _Layout(files=[single])
    if index.exists():
        _regular(index)
        listed = _index_files(index, model_dir)
        return _Layout(files=list(listed), index=index, listed=listed)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files in the model directory")
    for path in files:
        _regular(path)
    return _Layout(files=files)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in the order they are read.

    Raises
    ------
    CheckpointError
        No weight files, a directory readers would load differently (see the module
        docstring), an index entry outside the directory, or a file that is not a regular
        file.
    """
    return _layout(Path(model_dir)).files


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Any]:
    """``safe_open`` with a corrupt or truncated file reported as :class:`CheckpointError`."""
    _regular(path)  # never open a FIFO (the open blocks) or a device
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
    layout = _layout(model_dir)
    index, listed = layout.index, layout.listed
    entries: dict[str, _Entry] = {}
    for path in layout.files:
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
        if listed is not None and index is not None:
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
    stored_head = entries.get(_HEAD)
    if config.tie_word_embeddings and stored_head is None:
        expected.pop(_HEAD)  # the head is the embedding matrix
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
    if config.tie_word_embeddings and stored_head is not None:
        _check_tied_head(stored_head, entries[_EMBEDDINGS])
        del entries[_HEAD]
    state = _stream(entries, torch.device(device), dtype)
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model.eval()
    model.requires_grad_(False)
    return model


def _check_tied_head(head: _Entry, embeddings: _Entry) -> None:
    """A stored head beside ``tie_word_embeddings: true`` must equal the embeddings.

    Readers disagree about such a head (``transformers``' NemotronH ignores the flag and
    uses the stored head; vLLM and sglang tie the head to the embeddings and drop it), so
    one that differs is refused. Reads the two tensors once, before the weights stream.
    """
    with _open(head.path) as f:
        stored = f.get_tensor(head.name)
    with _open(embeddings.path) as f:
        emb = f.get_tensor(embeddings.name)
    same = torch.equal(stored.to(emb.dtype), emb)
    del stored, emb
    if not same:
        raise CheckpointError(
            f"{head.path}: config.json sets 'tie_word_embeddings' true, but the checkpoint "
            f"stores a {head.name!r} that differs from {embeddings.name!r}; readers load "
            "this differently (transformers' NemotronH ignores the flag and uses the stored "
            "head, vLLM and sglang the embeddings): set 'tie_word_embeddings' false to use "
            f"the stored head, or remove {head.name!r}"
        )


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
