"""Checkpoints written by ``transformers``' ``save_pretrained`` load and pass the main job.

transformers 5.x writes ``"time_step_limit": [0.0, {"__float__": "Infinity"}]``, names
layers ``linear_attention`` / ``full_attention`` in ``layers_block_type``, stores weights
under ``backbone.`` and shards them with an index. The checkpoints here have a shape the
embedded model never has (pattern ``M-*M*``, 6 query heads over 3 KV heads, head_dim 4).
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmeta.runtime import job as job_module
from hybridmeta.runtime.config import ConfigError, NemotronHConfig, read_config
from hybridmeta.runtime.job import main_job
from hybridmeta.runtime.loader import CheckpointError, load_nemotron_h, runtime_name
from hybridmeta.runtime.model import NemotronH
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


# --- where the loader and transformers could read one directory differently ---------------
#
# Each test below edits a save_pretrained directory so that two readings are possible,
# loads it with transformers (pinning what transformers does: the refusals' messages say
# it) and with the loader, which either reads what transformers reads (the weights are
# compared) or refuses, naming the conflict.

DELETE = object()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_pretrained(tmp_path_factory.mktemp("saved") / "single", max_shard_size=None)


@pytest.fixture(scope="module")
def saved_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_pretrained(tmp_path_factory.mktemp("saved") / "sharded", max_shard_size="8KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(d: Path, **changes: object) -> None:
    raw = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    (d / "config.json").write_text(json.dumps(raw))


def _hf(d: Path) -> tuple[Any, dict[str, Any]]:
    """transformers' model of ``d`` and its loading report."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model, info = transformers.NemotronHForCausalLM.from_pretrained(
            str(d), dtype=torch.float32, output_loading_info=True
        )
    finally:
        transformers.utils.logging.enable_progress_bar()
    return model.eval(), info


def _assert_same_weights(ours: NemotronH, hf: Any) -> None:
    """Every parameter of ours equals transformers' (``model.`` prefix in memory)."""
    theirs = hf.state_dict()
    ours_sd = ours.state_dict()
    assert len(ours_sd) == len(theirs)
    for key, value in ours_sd.items():
        other = theirs[key if key.startswith("lm_head.") else f"model.{key}"]
        assert torch.equal(value, other), key


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(str(p)).items()}


def test_pattern_and_block_types_that_agree_load_as_transformers(
    saved: Path, tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, hybrid_override_pattern="M-*M*")
    hf, _ = _hf(d)
    ours = load_nemotron_h(d)
    assert ours.config.pattern == "M-*M*" == hf.config.hybrid_override_pattern
    _assert_same_weights(ours, hf)


@pytest.mark.parametrize(
    ("changes", "read_by_transformers", "message"),
    [
        pytest.param(
            {"hybrid_override_pattern": "M*-M*"},
            "M-*M*",
            r"'layers_block_type' \('M-\*M\*'\) and 'hybrid_override_pattern' \('M\*-M\*'\) "
            r"describe different layers, which readers resolve differently \(transformers 5 "
            r"reads 'layers_block_type'",
            id="pattern-vs-block-types",
        ),
        pytest.param(
            {"layer_types": ["mamba", "attention", "mlp", "mamba", "attention"]},
            "M*-M*",
            r"'layer_types' \('M\*-M\*'\) and 'layers_block_type' \('M-\*M\*'\) describe "
            r"different layers.*transformers 5 reads 'layer_types'",
            id="layer-types-vs-block-types",
        ),
    ],
)
def test_layer_lists_that_disagree_are_refused(
    saved: Path, tmp_path: Path, changes: dict[str, Any], read_by_transformers: str, message: str
) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, **changes)
    # transformers reads one of them without a word (its model differs from the other)
    assert transformers.NemotronHConfig.from_pretrained(str(d)).hybrid_override_pattern == (
        read_by_transformers
    )
    with pytest.raises(ConfigError, match=message):
        load_nemotron_h(d)


def test_a_legacy_key_that_disagrees_is_refused(saved: Path, tmp_path: Path) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, mamba_chunk_size=8)  # chunk_size is 4
    assert transformers.NemotronHConfig.from_pretrained(str(d)).chunk_size == 8  # the legacy key
    with pytest.raises(
        ConfigError,
        match=r"'mamba_chunk_size' 8 and 'chunk_size' 4 disagree, which readers resolve "
        r"differently \(transformers reads the legacy 'mamba_chunk_size'\)",
    ):
        load_nemotron_h(d)
    _edit(d, chunk_size=DELETE, mamba_chunk_size=4)  # the legacy key alone: read as transformers
    hf, _ = _hf(d)
    ours = load_nemotron_h(d)
    assert ours.config.chunk_size == hf.config.chunk_size == 4
    _assert_same_weights(ours, hf)


def test_a_missing_head_dim_is_transformers_default(saved: Path, tmp_path: Path) -> None:
    """transformers ignores 'attention_head_dim' and takes head_dim 128 when 'head_dim' is
    absent (it does not derive hidden_size / heads); the weights here have head_dim 4."""
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, head_dim=DELETE, attention_head_dim=4)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _hf(d)  # transformers builds head_dim 128 and refuses the stored q_proj
    with pytest.raises(
        ConfigError,
        match=r"'head_dim' is missing and 'attention_head_dim' is 4, which readers resolve "
        r"differently \(transformers ignores 'attention_head_dim' and takes its default "
        r"head_dim 128\); set 'head_dim'",
    ):
        load_nemotron_h(d)
    _edit(d, attention_head_dim=DELETE)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight: \(24, 24\) != \(768, 24\)"):
        load_nemotron_h(d)  # head_dim 128, as transformers: the shapes say why


def test_index_beside_a_stale_single_file_is_refused(saved_sharded: Path, tmp_path: Path) -> None:
    d = _copy(saved_sharded, tmp_path / "ckpt")
    stale = {k: v + 1.0 for k, v in _weights(d).items()}
    save_file(stale, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf, _ = _hf(d)
    assert torch.equal(hf.lm_head.weight, stale["lm_head.weight"])  # transformers: the single file
    with pytest.raises(
        CheckpointError,
        match=r"holds both model\.safetensors and model\.safetensors\.index\.json, which readers "
        r"load differently \(transformers: model\.safetensors alone; vLLM, sglang: the shards "
        r"of the index\); remove the stale one",
    ):
        load_nemotron_h(d)
    (d / "model.safetensors").unlink()
    hf, _ = _hf(d)
    _assert_same_weights(load_nemotron_h(d), hf)


def test_single_file_beside_other_safetensors_without_an_index_is_refused(
    saved: Path, tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    save_file({"extra": torch.zeros(2)}, str(d / "adapter.safetensors"))
    _, info = _hf(d)  # transformers reads model.safetensors alone
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.raises(
        CheckpointError,
        match=r"holds model\.safetensors and other \*\.safetensors files \['adapter\.safetensors'\] "
        r"without an index, which readers load differently",
    ):
        load_nemotron_h(d)


def test_transformers_weights_names_the_file_both_read(saved: Path, tmp_path: Path) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    (d / "model.safetensors").rename(d / "weights.safetensors")
    stale = {k: v + 1.0 for k, v in _weights(d).items()}
    save_file(stale, str(d / "model.safetensors"), metadata={"format": "pt"})
    _edit(d, transformers_weights="weights.safetensors")
    hf, _ = _hf(d)
    ours = load_nemotron_h(d)
    assert not torch.equal(ours.lm_head.weight, stale["lm_head.weight"])
    _assert_same_weights(ours, hf)
    _edit(d, transformers_weights="../weights.safetensors")
    with pytest.raises(ValueError, match="must reference a file inside the model directory"):
        _hf(d)
    with pytest.raises(CheckpointError, match=r"'transformers_weights' names '\.\./weights"):
        load_nemotron_h(d)


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_entries_outside_the_directory_are_refused(
    saved_sharded: Path, tmp_path: Path, where: str
) -> None:
    d = _copy(saved_sharded, tmp_path / "ckpt")
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    shard = sorted(set(raw["weight_map"].values()))[0]
    outside = tmp_path / "outside.safetensors"
    (d / shard).rename(outside)
    entry = "../outside.safetensors" if where == "parent" else str(outside)
    raw["weight_map"] = {k: entry if v == shard else v for k, v in raw["weight_map"].items()}
    index.write_text(json.dumps(raw))
    # transformers up to 5.24 follows the entry out of the directory; from 5.25 it refuses
    # it too (hub.py: "points outside the model directory").
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.25"):
        with pytest.raises(ValueError, match="points outside the model directory"):
            _hf(d)
    else:
        hf, info = _hf(d)
        assert not info["missing_keys"]
        theirs = hf.state_dict()
        for name, value in load_file(str(outside)).items():
            assert torch.equal(theirs[name.replace("backbone.", "model.", 1)], value), name
    with pytest.raises(
        CheckpointError,
        match=rf"'weight_map' entry '.*' names '{re.escape(entry)}', which is not a file inside "
        r"the model directory .* \(absolute paths and '\.\.' are refused\)",
    ) as caught:
        load_nemotron_h(d)
    assert str(caught.value).startswith(f"{index}: ")


def test_tied_embeddings_with_a_stored_head_that_differs_are_refused(
    saved: Path, tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, tie_word_embeddings=True)
    stored = _weights(d)
    hf, _ = _hf(d)  # transformers' NemotronH ignores the flag: the stored head, untied
    assert torch.equal(hf.lm_head.weight, stored["lm_head.weight"])
    assert not torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: config\.json sets 'tie_word_embeddings' true, but the "
        r"checkpoint stores a 'lm_head\.weight' that differs from 'backbone\.embeddings\.weight'"
        r"; readers load this differently",
    ):
        load_nemotron_h(d)


def test_tied_embeddings_with_the_same_stored_head_load_as_transformers(
    saved: Path, tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, tie_word_embeddings=True)
    sd = _weights(d)
    sd["lm_head.weight"] = sd["backbone.embeddings.weight"].clone()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf, _ = _hf(d)
    ours = load_nemotron_h(d)
    assert ours.lm_head.weight is ours.embeddings.weight
    _assert_same_weights(ours, hf)


def test_tied_embeddings_without_a_head_skip_the_transformers_comparison(
    saved: Path, tmp_path: Path
) -> None:
    """The loader ties the head to the embeddings; transformers leaves it random."""
    d = _copy(saved, tmp_path / "ckpt")
    _edit(d, tie_word_embeddings=True)
    sd = _weights(d)
    del sd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, info = _hf(d)
    assert info["missing_keys"] == {"lm_head.weight"}
    ours = load_nemotron_h(d)
    assert ours.lm_head.weight is ours.embeddings.weight
    why = job_module._transformers_logprobs(
        d, [], ours.config, torch.device("cpu"), torch.float32, quiet=True
    )
    assert why == (
        f"transformers leaves ['lm_head.weight'] of {d} unloaded "
        "(its NemotronH ignores 'tie_word_embeddings')"
    )


def test_the_embedding_alias_is_not_read(saved: Path, tmp_path: Path) -> None:
    """transformers renames only 'backbone.' to 'model.': 'backbone.embedding.weight' is not
    its embeddings (they stay random there), so the loader does not read it either."""
    d = _copy(saved, tmp_path / "ckpt")
    sd = _weights(d)
    sd["backbone.embedding.weight"] = sd.pop("backbone.embeddings.weight")
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, info = _hf(d)
    assert "model.embeddings.weight" in info["missing_keys"]
    with pytest.raises(
        CheckpointError,
        match=r"missing 1: \['embeddings\.weight'\]; unexpected 1: \['embedding\.weight'\]",
    ):
        load_nemotron_h(d)


@pytest.mark.parametrize("layout", ["glob", "index-without-metadata"])
def test_directories_transformers_cannot_load_skip_its_comparison(
    saved: Path, saved_sharded: Path, tmp_path: Path, layout: str
) -> None:
    """The loader reads them (as vLLM does); transformers refuses: the job's comparison is
    reported as skipped with transformers' reason."""
    if layout == "glob":
        d = _copy(saved, tmp_path / "ckpt")
        (d / "model.safetensors").rename(d / "weights.safetensors")
        reason = "OSError: Error no file named model.safetensors"
    else:
        d = _copy(saved_sharded, tmp_path / "ckpt")
        index = d / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": json.loads(index.read_text())["weight_map"]}))
        reason = "KeyError: 'metadata'"
    with pytest.raises(Exception, match=re.escape(reason.split(": ", 1)[1])):
        _hf(d)
    ours = load_nemotron_h(d)
    why = job_module._transformers_logprobs(
        d, [], ours.config, torch.device("cpu"), torch.float32, quiet=True
    )
    assert isinstance(why, str) and why.startswith(f"transformers cannot load {d} ({reason}")
