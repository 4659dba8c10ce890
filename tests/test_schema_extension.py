"""Fields added to ``ForwardMetadata``'s declaration flow everywhere with no other edit.

The test copies the package, adds three fields to the ``ForwardMetadata`` declaration and
nothing else (a per-row engine tensor, a host value and a second pool's slot field, the
kind sglang's hand-written constructors dropped: ``mamba_cache_indices_gdn``), and runs a
Hypothesis-driven script in a subprocess. The script builds each forward through the
library's own paths (the planner for a mixed forward with decode rows, ``prepare_decode``
for an eager decode, the static buffers and a captured graph for a graph decode), runs
the Mamba2 layer of the reference runtime on it with a spy on every Mamba2 entry point,
and checks that the metadata each entry point receives carries the new fields' values.
The slot field is buffered, padded with -1 and range-checked by the static buffers from
its declaration alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import hybridmeta

SRC = Path(hybridmeta.__file__).resolve().parent

NEW_FIELDS = '''
    engine_row_tag: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(-7), role=Role.ENGINE_ONLY, default=None,
        doc="[bs] a per-row field an engine adds later.",
    )
    engine_epoch: int = field(default=0, doc="A host field an engine adds later.")
    mamba_cache_indices_gdn: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=_PAD_SLOT, role=Role.SLOT, default=None,
        doc="[bs] a second state pool's slot of each row.",
    )

'''

SCRIPT = r'''
import torch
from hypothesis import given, settings, strategies as st

import hybridmeta.kernels as K
from hybridmeta import TOKENS, ForwardMetadata, prepare_decode, prepare_target_verify
from hybridmeta.graphs import EmulatedGraphBackend, GraphRunner, InputSpec, StaticBuffers
from hybridmeta.model import SpecCommitMetadata
from hybridmeta.planner import plan_host
from hybridmeta.runtime.model import Forward, Mamba2Mixer, NemotronH
from hybridmeta.runtime.state import StatePool
from hybridmeta.runtime.tiny import tiny_config
from hybridmeta.staging import to_device_packed

ENTRIES = (
    "causal_conv1d_prefill", "ssd_chunked_scan", "extend_track_save",
    "causal_conv1d_update_from_metadata", "ssm_state_update_from_metadata",
    "track_save_from_metadata", "conv_verify_update_from_metadata",
    "ssm_verify_update_from_metadata", "spec_commit_from_metadata",
)
VERIFY = {"conv_verify_update_from_metadata", "ssm_verify_update_from_metadata",
          "spec_commit_from_metadata"}
seen = []
for name in ENTRIES:
    def spy(*a, _orig=getattr(K, name), _name=name, **kw):
        seen.append((_name, kw["md"] if "md" in kw else a[0]))
        return _orig(*a, **kw)
    setattr(K, name, spy)

cfg = tiny_config()
torch.manual_seed(0)
model = NemotronH(cfg).eval()
mixer = next(b.mixer for b in model.layers if isinstance(b.mixer, Mamba2Mixer))
SLOTS = 12
pool = StatePool.allocate(cfg, num_working=8, num_track=4, max_len=64,
                          device=torch.device("cpu"), dtype=torch.float32,
                          verify_rows=4, verify_tokens=3)


def layer(md, tokens):
    h = torch.randn(tokens, cfg.hidden_size)
    with torch.no_grad():
        out = mixer.forward(h, Forward(md=md, pool=pool))
        K.track_save_from_metadata(md, pool.conv, pool.ssm)
    return {"y": out}


def check(md, tag, epoch, gdn, bs):
    assert md.engine_epoch == epoch, (md.engine_epoch, epoch)
    assert md.engine_row_tag[:bs].tolist() == tag, (md.engine_row_tag, tag)
    assert md.mamba_cache_indices_gdn[:bs].tolist() == gdn
    if md.engine_row_tag.shape[0] > bs:  # a graph bucket: the declared pads
        assert set(md.engine_row_tag[bs:].tolist()) == {-7}
        assert set(md.mamba_cache_indices_gdn[bs:].tolist()) == {-1}


def received(expect):
    got = {name for name, _ in seen}
    assert got >= expect, (sorted(expect - got))
    return [md for _, md in seen]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(data=st.data())
def test_flow(data):
    bs = data.draw(st.integers(2, 4))
    tag = data.draw(st.lists(st.integers(0, 1000), min_size=bs, max_size=bs))
    gdn = data.draw(st.lists(st.integers(-1, SLOTS - 1), min_size=bs, max_size=bs))
    epoch = data.draw(st.integers(1, 10**6))
    eng = lambda: {
        "engine_row_tag": torch.tensor(tag), "engine_epoch": epoch,
        "mamba_cache_indices_gdn": torch.tensor(gdn),
    }

    # 1. mixed forward (the planner): prefill rows with track boundaries and a decode row
    seen.clear()
    ext = [5, 9] + [1] * (bs - 2)
    hp = plan_host(
        extend_lens=ext, prefix_lens=[0, 3] + [7] * (bs - 2), slots=list(range(bs)),
        num_decodes=bs - 2, chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
        track_interval=cfg.chunk_size, track_mask=[True] * bs,
        track_slots=list(range(8, 8 + bs)),
    )
    md = hp.metadata(to_device_packed(hp.arrays, torch.device("cpu")), **eng())
    layer(md, sum(ext))
    expect = {"causal_conv1d_prefill", "ssd_chunked_scan", "extend_track_save",
              "track_save_from_metadata"}
    if bs > 2:
        expect |= {"causal_conv1d_update_from_metadata", "ssm_state_update_from_metadata"}
    for m in received(expect):
        check(m, tag, epoch, gdn, bs)

    # 2. eager decode
    seen.clear()
    fwd = ForwardMetadata(query_start_loc=torch.arange(bs + 1),
                          mamba_cache_indices=torch.arange(bs), **eng())
    layer(prepare_decode(fwd), bs)
    for m in received({"causal_conv1d_update_from_metadata",
                       "ssm_state_update_from_metadata", "track_save_from_metadata"}):
        check(m, tag, epoch, gdn, bs)

    # 3. graph decode: buffers declared from the schema alone (the epoch is frozen at capture)
    seen.clear()
    buffers = StaticBuffers(max_bs=4, num_slots=SLOTS, device="cpu",
                            static={"engine_epoch": epoch},
                            inputs={"h": InputSpec((cfg.hidden_size,), torch.float32)})
    assert {"engine_row_tag", "mamba_cache_indices_gdn"} <= set(buffers.field_names)

    def step(md, ins):
        with torch.no_grad():
            y = mixer.forward(ins["h"], Forward(md=md, pool=pool))
            K.track_save_from_metadata(md, pool.conv, pool.ssm)
        return {"y": y}

    runner = GraphRunner(step, buffers, buckets=[4], backend=EmulatedGraphBackend("cpu"))
    runner.capture()
    captured = received({"causal_conv1d_update_from_metadata",
                         "ssm_state_update_from_metadata", "track_save_from_metadata"})
    runner.run(fwd, {"h": torch.randn(bs, cfg.hidden_size)})
    for m in captured:  # the captured metadata's views now hold the step's rows
        check(m, tag, epoch, gdn, bs)

    # 4. eager speculative verify of T drafts per row, then its commit
    seen.clear()
    T = data.draw(st.integers(1, 3))
    vfwd = ForwardMetadata(query_start_loc=torch.arange(bs + 1) * T,
                           mamba_cache_indices=torch.arange(bs), is_target_verify=True,
                           draft_token_num=T, **eng())
    vmd = prepare_target_verify(vfwd)
    with torch.no_grad():
        mixer.forward(torch.randn(bs * T, cfg.hidden_size), Forward(md=vmd, pool=pool))
    acc = torch.full((bs,), T - 1)
    cmd = SpecCommitMetadata.evolve_from(vmd, accepted_index=acc, track_token=-torch.ones(bs, dtype=torch.int64))
    K.spec_commit_from_metadata(cmd, pool.conv, pool.ssm, *pool.verify_states(bs, T))
    for m in received(VERIFY):
        check(m, tag, epoch, gdn, bs)

    # 5. graph verify + commit: buffers bucketed over (B, T), declared from the schema alone
    seen.clear()
    common = dict(max_bs=4, num_slots=SLOTS, device="cpu", max_draft=3,
                  static={"engine_epoch": epoch, "is_target_verify": True})
    vbuf = StaticBuffers(inputs={"h": InputSpec((cfg.hidden_size,), torch.float32, rows=TOKENS)},
                         **common)
    cbuf = StaticBuffers(metadata_class=SpecCommitMetadata, **common)
    for b in (vbuf, cbuf):
        assert {"engine_row_tag", "mamba_cache_indices_gdn"} <= set(b.field_names)

    def vstep(md, ins):
        with torch.no_grad():
            return {"y": mixer.forward(ins["h"], Forward(md=md, pool=pool))}

    def cstep(md, ins):
        K.spec_commit_from_metadata(md, pool.conv, pool.ssm,
                                    *pool.verify_states(md.num_decodes, md.draft_token_num))
        return {}

    vrun = GraphRunner(vstep, vbuf, buckets=[4], draft_buckets=[T, 3] if T < 3 else [3],
                       backend=EmulatedGraphBackend("cpu"))
    crun = GraphRunner(cstep, cbuf, buckets=[4], draft_buckets=[T, 3] if T < 3 else [3],
                       backend=EmulatedGraphBackend("cpu"))
    vrun.capture()
    crun.capture()
    captured = received(VERIFY)
    vrun.run(vfwd, {"h": torch.randn(bs * T, cfg.hidden_size)})
    crun.run(cmd)
    for m in captured:  # the captured (B, T) metadata's views now hold the step's rows
        if m.draft_token_num == T:
            check(m, tag, epoch, gdn, bs)

    # the new slot field is range-checked from its declaration
    bad = ForwardMetadata(query_start_loc=torch.arange(2), mamba_cache_indices=torch.tensor([0]),
                          engine_epoch=epoch, mamba_cache_indices_gdn=torch.tensor([SLOTS]))
    try:
        buffers.refresh(bad, 1 if 1 in runner.buckets else 4, {"h": torch.zeros(1, cfg.hidden_size)})
    except ValueError as e:
        assert "mamba_cache_indices_gdn row 0 holds 12" in str(e), e
    else:
        raise AssertionError("an out-of-range slot of the new field was written")


test_flow()
print("FLOW OK")
'''


def _extended_package(root: Path) -> Path:
    pkg = root / "hybridmeta"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    model = pkg / "model.py"
    text = model.read_text()
    anchor = "    def __validate__(self) -> None:\n        if self.draft_token_num < 1:"
    assert text.count(anchor) == 1, "ForwardMetadata.__validate__ moved: update the anchor"
    model.write_text(text.replace(anchor, NEW_FIELDS + anchor))
    return root


def test_new_fields_reach_every_entry_point_with_no_other_edit(tmp_path: Path) -> None:
    root = _extended_package(tmp_path / "src")
    script = tmp_path / "flow.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "FLOW OK" in res.stdout
