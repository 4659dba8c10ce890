"""Loading Hugging Face checkpoint directories: layouts, prefixes, refusals."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridmeta.runtime.config import ConfigError
from hybridmeta.runtime.loader import CheckpointError, load_nemotron_h, runtime_name
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.tiny import tiny_config, tiny_state_dict, write_tiny_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loaded_weights_equal_the_file(tiny_dir: Path, tiny_model: NemotronH) -> None:
    on_disk = load_file(str(tiny_dir / "model.safetensors"))
    params = dict(tiny_model.state_dict())
    assert len(on_disk) == len(params)
    for name, t in on_disk.items():
        key = runtime_name(name)
        assert key is not None
        assert torch.equal(params[key], t), name


def test_names_map_from_both_prefixes() -> None:
    assert runtime_name("backbone.layers.0.mixer.A_log") == "layers.0.mixer.A_log"
    assert runtime_name("model.layers.3.mixer.q_proj.weight") == "layers.3.mixer.q_proj.weight"
    assert runtime_name("backbone.embedding.weight") == "embedding.weight"  # no alias
    assert runtime_name("lm_head.weight") == "lm_head.weight"
    assert runtime_name("mtp.layers.0.norm.weight") is None


def test_model_prefix_and_sharded_index_load_identically(
    tiny_dir: Path, tiny_model: NemotronH, tmp_path: Path
) -> None:
    sd = tiny_state_dict(tiny_config(), seed=0)
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in sd.items()}
    names = sorted(renamed)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: renamed[k] for k in keys}, str(tmp_path / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    model = load_nemotron_h(tmp_path)
    for (k1, v1), (k2, v2) in zip(
        model.state_dict().items(), tiny_model.state_dict().items(), strict=True
    ):
        assert k1 == k2
        assert torch.equal(v1, v2), k1


def test_dtype_and_device_are_applied(tiny_dir: Path) -> None:
    model = load_nemotron_h(tiny_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    sd = load_file(str(d / "model.safetensors"))
    del sd["backbone.layers.0.mixer.A_log"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1: \['layers\.0\.mixer\.A_log'\]"):
        load_nemotron_h(d)


def test_unexpected_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    sd = load_file(str(d / "model.safetensors"))
    sd["backbone.layers.1.mixer.q_proj.bias"] = torch.zeros(32)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"unexpected 1: \['layers\.1\.mixer\.q_proj\.bias'\]"
    ):
        load_nemotron_h(d)


def test_wrong_shape_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    sd = load_file(str(d / "model.safetensors"))
    sd["backbone.norm_f.weight"] = torch.ones(31)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"norm_f\.weight: \(31,\) != \(32,\)"):
        load_nemotron_h(d)


def test_moe_checkpoint_is_refused(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path / "ckpt")
    raw = json.loads((d / "config.json").read_text())
    raw["hybrid_override_pattern"] = "M*E-M*-M"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"MoE 'E' layers are not supported"):
        load_nemotron_h(d)


def test_missing_directory_and_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_nemotron_h(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_nemotron_h(tmp_path)


def _rewrite(d: Path, name: str, value: torch.Tensor) -> None:
    sd = load_file(str(d / "model.safetensors"))
    sd[name] = value
    save_file(sd, str(d / "model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            lambda t: t.to(torch.int32),
            r"tensor 'backbone\.layers\.0\.mixer\.A_log' has dtype I32; weights must be "
            r"floating point \(F32, BF16, F16, F64\)",
            id="int32",
        ),
        pytest.param(
            lambda t: t.bool(),
            r"tensor 'backbone\.layers\.0\.mixer\.A_log' has dtype BOOL",
            id="bool",
        ),
        pytest.param(
            lambda t: t.index_fill(0, torch.tensor([1]), float("nan")),
            r"tensor 'backbone\.layers\.0\.mixer\.A_log' holds NaN or inf values",
            id="nan",
        ),
        pytest.param(
            lambda t: t.index_fill(0, torch.tensor([0]), float("-inf")),
            r"tensor 'backbone\.layers\.0\.mixer\.A_log' holds NaN or inf values",
            id="inf",
        ),
    ],
)
def test_bad_weights_are_refused_with_the_file_and_tensor_name(
    tiny_dir: Path, tmp_path: Path, change: Any, message: str
) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    sd = load_file(str(d / "model.safetensors"))
    _rewrite(d, "backbone.layers.0.mixer.A_log", change(sd["backbone.layers.0.mixer.A_log"]))
    with pytest.raises(CheckpointError, match=message) as info:
        load_nemotron_h(d)
    assert str(info.value).startswith(str(d / "model.safetensors") + ": ")


def test_overflow_in_the_dtype_conversion_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    # finite in fp32, past float16's largest value (65504): inf after the conversion
    _rewrite(d, "backbone.norm_f.weight", torch.full((32,), 1e5))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'backbone\.norm_f\.weight' overflows to inf when converted to torch\.float16",
    ):
        load_nemotron_h(d, dtype=torch.float16)
    assert load_nemotron_h(d).norm_f.weight.max() == 1e5  # fp32 holds it


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(lambda b: b[: len(b) // 2], r"incomplete metadata", id="truncated-data"),
        pytest.param(lambda b: b[:20], r"invalid header length", id="truncated-header"),
        pytest.param(lambda b: b"hello, not a tensor file" * 4, r"header too large", id="garbage"),
        pytest.param(lambda b: b"", r"header too small", id="empty"),
    ],
)
def test_corrupt_safetensors_are_refused_with_the_file_name(
    tiny_dir: Path, tmp_path: Path, content: Any, message: str
) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    f = d / "model.safetensors"
    f.write_bytes(content(f.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as info:
        load_nemotron_h(d)
    assert str(info.value).startswith(f"{f}: not a valid safetensors file (truncated or corrupt: ")


def _sharded(tiny_dir: Path, root: Path) -> Path:
    """The tiny checkpoint as two shards plus an index."""
    root.mkdir()
    sd = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(sd)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(root / fname))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(tiny_dir / "config.json", root / "config.json")
    return root


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param("", r"the file is empty \(expected a JSON object\)", id="empty"),
        pytest.param('{"weight_map": {', r"not valid JSON \(Expecting", id="corrupt"),
        pytest.param("[]", r"'weight_map' must be a non-empty object", id="not-an-object"),
        pytest.param(
            '{"weight_map": {}}', r"'weight_map' must be a non-empty object", id="empty-map"
        ),
        pytest.param(
            '{"weight_map": {"lm_head.weight": 3}}',
            r"'weight_map' must be a non-empty object mapping tensor names to shard file names",
            id="not-a-file-name",
        ),
        pytest.param(
            '{"weight_map": {"lm_head.weight": "c.safetensors"}}',
            r"listed shard files are missing: \[.*c\.safetensors'\]",
            id="missing-shard",
        ),
        pytest.param(
            "SWAP",
            r"'weight_map' puts \['lm_head\.weight'\] in [ab]\.safetensors, "
            r"which does not hold them",
            id="wrong-shard",
        ),
    ],
)
def test_bad_index_is_refused_with_the_file_name(
    tiny_dir: Path, tmp_path: Path, content: str, message: str
) -> None:
    d = _sharded(tiny_dir, tmp_path / "ckpt")
    index = d / "model.safetensors.index.json"
    if content == "SWAP":  # the index puts one tensor in the other shard
        weight_map = json.loads(index.read_text())["weight_map"]
        other = {"a.safetensors": "b.safetensors", "b.safetensors": "a.safetensors"}
        weight_map["lm_head.weight"] = other[weight_map["lm_head.weight"]]
        content = json.dumps({"weight_map": weight_map})
    index.write_text(content)
    with pytest.raises(CheckpointError, match=message) as info:
        load_nemotron_h(d)
    assert str(info.value).startswith(f"{index}: ")


class _CountingSafeOpen:
    """Wraps ``safe_open``: how many files are open at once and which tensors it handed
    out are still alive each time a new one is read."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.open_now = 0
        self.most_open = 0
        self.handed_out: list[weakref.ref[torch.Tensor]] = []
        self.most_alive = 0
        self.reads = 0

    def __call__(self, path: str, framework: str) -> Any:
        counter = self
        handle = self.real(path, framework=framework)

        class Handle:
            def __enter__(self) -> Any:
                counter.open_now += 1
                counter.most_open = max(counter.most_open, counter.open_now)
                inner = handle.__enter__()

                class Reader:
                    def keys(self) -> list[str]:
                        return list(inner.keys())

                    def get_slice(self, name: str) -> Any:
                        return inner.get_slice(name)

                    def get_tensor(self, name: str) -> torch.Tensor:
                        alive = sum(r() is not None for r in counter.handed_out)
                        counter.most_alive = max(counter.most_alive, alive)
                        t: torch.Tensor = inner.get_tensor(name)
                        counter.handed_out.append(weakref.ref(t))
                        counter.reads += 1
                        return t

                return Reader()

            def __exit__(self, *exc: object) -> None:
                counter.open_now -= 1
                handle.__exit__(*exc)

        return Handle()


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_weights_stream_one_tensor_at_a_time(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Loading fp32 weights as bf16: every fp32 tensor read from a file must be gone before
    the next is read (no second copy of the model in host memory), and one file is open
    at a time. Reading everything first, then converting, keeps them all alive."""
    d = tiny_dir if layout == "single" else _sharded(tiny_dir, tmp_path / "ckpt")
    counter = _CountingSafeOpen(safe_open)
    monkeypatch.setattr("hybridmeta.runtime.loader.safe_open", counter)
    model = load_nemotron_h(d, dtype=torch.bfloat16)
    n = len(model.state_dict())
    assert counter.reads == n > 10
    assert counter.most_alive == 0
    assert counter.most_open == 1
    assert all(r() is None for r in counter.handed_out)  # only the bf16 copies remain
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


_UNBLOCK = """
import os, stat, sys, time
from pathlib import Path
time.sleep(float(sys.argv[2]))
for p in Path(sys.argv[1]).rglob("*"):
    if stat.S_ISFIFO(os.lstat(p).st_mode):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody is reading it
        except OSError:
            continue
        os.write(fd, b"garbage")
        os.close(fd)
"""


class UnblockFifos:
    """After ``after`` seconds, a separate process opens every FIFO under a directory for
    writing (then closes it), so a loader that wrongly opens one fails the test instead of
    hanging it. A process, not a thread: a reader blocked in ``open`` may hold the GIL."""

    def __init__(self, root: Path, after: float = 20.0) -> None:
        self._argv = [sys.executable, "-c", _UNBLOCK, str(root), str(after)]
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> UnblockFifos:
        self._proc = subprocess.Popen(self._argv)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.kill()
        self._proc.wait()


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize(
    ("layout", "name"),
    [
        pytest.param("single", "model.safetensors", id="single-file"),
        pytest.param("glob", "weights.safetensors", id="glob"),
        pytest.param("sharded", "a.safetensors", id="shard"),
        pytest.param("sharded", "model.safetensors.index.json", id="index"),
        pytest.param("single", "config.json", id="config"),
    ],
)
def test_a_fifo_is_refused_before_it_is_opened(
    tiny_dir: Path, tmp_path: Path, layout: str, name: str
) -> None:
    """Opening a FIFO blocks until a writer comes: the loader must refuse it unopened."""
    d = (
        _sharded(tiny_dir, tmp_path / "ckpt")
        if layout == "sharded"
        else _copy(tiny_dir, tmp_path / "ckpt")
    )
    if layout == "glob":
        (d / "model.safetensors").rename(d / "b.safetensors")
    fifo = _fifo(d / name)
    error = ConfigError if name == "config.json" else CheckpointError
    with UnblockFifos(d), pytest.raises(error) as info:
        load_nemotron_h(d)
    assert str(info.value) == f"{fifo}: is a FIFO, not a regular file; only regular files are read"


def test_other_non_regular_files_are_refused(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    (d / "model.safetensors").rename(d / "a.safetensors")
    (d / "b.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"b\.safetensors: is a directory, not a regular"):
        load_nemotron_h(d)
    (d / "b.safetensors").rmdir()
    if Path("/dev/zero").exists():  # reads forever
        (d / "b.safetensors").symlink_to("/dev/zero")
        with pytest.raises(CheckpointError, match=r"b\.safetensors: is a character device"):
            load_nemotron_h(d)
        (d / "b.safetensors").unlink()
    (d / "b.safetensors").symlink_to(d / "nowhere.safetensors")
    with pytest.raises(CheckpointError, match=r"b\.safetensors: missing \(a dangling symbolic"):
        load_nemotron_h(d)


def test_symbolic_links_to_regular_files_are_read(tiny_dir: Path, tmp_path: Path) -> None:
    """The Hugging Face cache links a snapshot's files to blobs outside the snapshot: the
    containment rule is on the names the index lists, not on where links lead."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    d = _sharded(tiny_dir, tmp_path / "snapshot")
    for p in list(d.iterdir()):
        p.rename(blobs / p.name)
        p.symlink_to(blobs / p.name)
    model = load_nemotron_h(d)
    assert torch.equal(model.norm_f.weight, load_nemotron_h(tiny_dir).norm_f.weight)


@pytest.mark.parametrize(
    "entry", ["../a.safetensors", "sub/../../a.safetensors", "/abs/a.safetensors", ".."]
)
def test_index_entries_must_stay_inside_the_directory(
    tiny_dir: Path, tmp_path: Path, entry: str
) -> None:
    d = _sharded(tiny_dir, tmp_path / "ckpt")
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["lm_head.weight"] = entry
    index.write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(index))}: 'weight_map' entry 'lm_head\.weight' names "
        rf"'{re.escape(entry)}', which is not a file inside the model directory",
    ):
        load_nemotron_h(d)


def test_index_entries_inside_a_subdirectory_are_read(tiny_dir: Path, tmp_path: Path) -> None:
    d = _sharded(tiny_dir, tmp_path / "ckpt")
    (d / "sub").mkdir()
    (d / "b.safetensors").rename(d / "sub" / "b.safetensors")
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"] = {
        k: ("sub/./b.safetensors" if v == "b.safetensors" else v)
        for k, v in raw["weight_map"].items()
    }
    index.write_text(json.dumps(raw))
    model = load_nemotron_h(d)
    assert torch.equal(model.lm_head.weight, load_nemotron_h(tiny_dir).lm_head.weight)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, r"'transformers_weights' must name a \*\.safetensors or \*\.safetensors\.index\.json"),
        ("weights.bin", r"'transformers_weights' must name a \*\.safetensors"),
        (
            "gone.safetensors",
            r"gone\.safetensors: missing \(.*config\.json: 'transformers_weights'",
        ),
        ("/etc/x.safetensors", r"'transformers_weights' names '/etc/x\.safetensors', which is not"),
    ],
)
def test_bad_transformers_weights_are_refused(
    tiny_dir: Path, tmp_path: Path, value: object, message: str
) -> None:
    d = _copy(tiny_dir, tmp_path / "ckpt")
    raw = json.loads((d / "config.json").read_text())
    raw["transformers_weights"] = value
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises((ConfigError, CheckpointError), match=message):
        load_nemotron_h(d)


def test_transformers_weights_may_name_an_index(tiny_dir: Path, tmp_path: Path) -> None:
    d = _sharded(tiny_dir, tmp_path / "ckpt")
    (d / "model.safetensors.index.json").rename(d / "other.safetensors.index.json")
    shutil.copy(d / "a.safetensors", d / "model.safetensors")  # ignored: the config names the index
    raw = json.loads((d / "config.json").read_text())
    raw["transformers_weights"] = "other.safetensors.index.json"
    (d / "config.json").write_text(json.dumps(raw))
    model = load_nemotron_h(d)
    assert torch.equal(model.lm_head.weight, load_nemotron_h(tiny_dir).lm_head.weight)
