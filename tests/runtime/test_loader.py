"""Loading Hugging Face checkpoint directories: layouts, prefixes, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
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
    assert runtime_name("backbone.embedding.weight") == "embeddings.weight"
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
