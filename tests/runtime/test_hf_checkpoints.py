"""Checkpoints written by ``transformers``' ``save_pretrained`` load and pass the main job.

transformers 5.x writes ``"time_step_limit": [0.0, {"__float__": "Infinity"}]``, names
layers ``linear_attention`` / ``full_attention`` in ``layers_block_type``, stores weights
under ``backbone.`` and shards them with an index. The checkpoints here have a shape the
embedded model never has (pattern ``M-*M*``, 6 query heads over 3 KV heads, head_dim 4).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridmeta.runtime.config import NemotronHConfig, read_config
from hybridmeta.runtime.job import main_job
from hybridmeta.runtime.loader import load_nemotron_h, runtime_name
from hybridmeta.runtime.tiny import tiny_state_dict

transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["mamba", "mlp", "attention", "mamba", "attention"]


def _shape() -> NemotronHConfig:
    return NemotronHConfig(
        vocab_size=80,
        hidden_size=24,
        pattern="M-*M*",
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=4,
        intermediate_size=40,
        mamba_num_heads=6,
        mamba_head_dim=4,
        ssm_state_size=4,
        n_groups=3,
        conv_kernel=3,
        chunk_size=4,
        layer_norm_epsilon=1e-5,
        use_conv_bias=True,
        use_bias=False,
        mlp_bias=False,
        time_step_min=0.001,
        tie_word_embeddings=False,
    )


def _save_pretrained(directory: Path, *, max_shard_size: str | None) -> Path:
    """A seeded ``NemotronHForCausalLM`` written by ``save_pretrained``.

    The weights are the embedded model's seeded scales (peaky logits, fast and slow SSM
    heads), so agreement is not the trivial agreement of near-uniform outputs.
    """
    cfg = _shape()
    hf_cfg = transformers.NemotronHConfig(
        **{
            k: v
            for k, v in cfg.to_hf_dict().items()
            if k not in ("architectures", "hybrid_override_pattern", "num_hidden_layers")
        },
        layers_block_type=LAYER_TYPES,
    )
    model = transformers.NemotronHForCausalLM(hf_cfg)
    weights = {
        # in memory transformers names the backbone "model."; it writes "backbone."
        k.replace("backbone.", "model.", 1): v
        for k, v in tiny_state_dict(cfg, seed=3).items()
    }
    model.load_state_dict(weights, strict=True)
    transformers.utils.logging.disable_progress_bar()
    try:
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(str(directory), **kwargs)
    finally:
        transformers.utils.logging.enable_progress_bar()
    return directory


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_save_pretrained_checkpoint_runs_the_main_job(tmp_path: Path, layout: str) -> None:
    sharded = layout == "sharded"
    d = _save_pretrained(tmp_path / layout, max_shard_size="8KB" if sharded else None)
    raw_text = (d / "config.json").read_text()
    # what this test exists for: transformers 5.x's spelling of infinity is in the file
    assert '"__float__": "Infinity"' in raw_text
    assert "layers_block_type" in raw_text and "hybrid_override_pattern" not in raw_text
    shards = sorted(d.glob("*.safetensors"))
    if sharded:
        assert (d / "model.safetensors.index.json").is_file()
        assert len(shards) > 2
    else:
        assert [p.name for p in shards] == ["model.safetensors"]
    assert read_config(d) == _shape()

    # the weights land unchanged
    model = load_nemotron_h(d)
    params = dict(model.state_dict())
    on_disk = {runtime_name(k): v for p in shards for k, v in load_file(str(p)).items()}
    assert len(on_disk) == len(params)
    for key, t in on_disk.items():
        assert key is not None
        assert torch.equal(params[key], t), key

    out, err = io.StringIO(), io.StringIO()
    rc = main_job(
        ["--model", str(d), "--device", "cpu", "--quiet", "--prompts", "2"], out=out, err=err
    )
    text = out.getvalue()
    assert rc == 0, text + err.getvalue()
    assert err.getvalue() == ""
    assert "all checks passed" in text
    assert "Nemotron-H M*-M* " not in text and "Nemotron-H M-*M* (hidden 24, vocab 80)" in text
    hf_line = next(ln for ln in text.splitlines() if ln.startswith("agreement with transformers"))
    assert "PASS" in hf_line and "6 requests" in hf_line  # 2 prompts + 2 continuations each


def test_config_json_of_save_pretrained_is_what_the_reader_expects(tmp_path: Path) -> None:
    """Pins the encoding: if transformers changes how it writes infinity, this says so."""
    transformers.NemotronHConfig(layers_block_type=["mamba"]).save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
