"""Which metadata fields each Mamba2 entry point reads, recorded, against the declared roles.

Every field of ``ForwardMetadata`` (and of ``Mamba2Metadata`` and ``SpecCommitMetadata``
derived from it) is a slot of a frozen class, read through a member descriptor of the
class that declared it. While the reference runtime's Mamba2 layer runs a mixed forward
(prefill rows with mid-row and final track boundaries, decode rows), a decode forward and a
speculative verify forward with its commit, each of those descriptors is swapped for a
recording one, and every entry point of :mod:`hybridmeta.kernels` is wrapped so the read is
charged to the entry point that made it (reads by the layer itself, the validators and
``evolve_from`` are not charged). Every forward sets every optional field, so an entry
point that could read one has the chance.

The rules, from the declarations alone:

* a field no entry point reads must be declared ``Role.ENGINE_ONLY`` (it is carried for the
  engine, not for the layers: dead weight otherwise, or a field someone forgot to wire);
* a field declared ``Role.ENGINE_ONLY`` must not be read by any entry point.

The table is printed and must equal the one in ``docs/fields.md``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hybridmeta.kernels as K
from hybridmeta import ForwardMetadata, Role, fields_of, prepare_decode, prepare_target_verify
from hybridmeta.model import Mamba2Metadata, SpecCommitMetadata
from hybridmeta.planner import plan_host
from hybridmeta.runtime.model import Forward, Mamba2Mixer, NemotronH
from hybridmeta.runtime.state import StatePool
from hybridmeta.runtime.tiny import tiny_config
from hybridmeta.staging import to_device_packed

#: Entry points in the order of a forward: (column label, name in hybridmeta.kernels).
ENTRIES: tuple[tuple[str, str], ...] = (
    ("prefill conv", "causal_conv1d_prefill"),
    ("scan", "ssd_chunked_scan"),
    ("extend track", "extend_track_save"),
    ("decode conv", "causal_conv1d_update_from_metadata"),
    ("decode SSM", "ssm_state_update_from_metadata"),
    ("track save", "track_save_from_metadata"),
    ("verify conv", "conv_verify_update_from_metadata"),
    ("verify SSM", "ssm_verify_update_from_metadata"),
    ("commit", "spec_commit_from_metadata"),
)
CLASSES = (ForwardMetadata, Mamba2Metadata, SpecCommitMetadata)
DOC = Path(__file__).resolve().parents[1] / "docs" / "fields.md"


class _Recorder:
    """A member descriptor that logs reads made while an entry point runs."""

    def __init__(self, name: str, inner: Any, log: dict[str, set[str]], current: list[str]):
        self.name, self.inner, self.log, self.current = name, inner, log, current

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is not None and self.current:
            self.log.setdefault(self.name, set()).add(self.current[-1])
        return self.inner.__get__(obj, objtype)

    def __set__(self, obj: object, value: object) -> None:
        self.inner.__set__(obj, value)


@contextlib.contextmanager
def _recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    log: dict[str, set[str]] = {}
    current: list[str] = []
    for cls in CLASSES:
        for name in {s.name for s in fields_of(cls)} & set(vars(cls)):
            inner = vars(cls)[name]
            assert type(inner).__name__ == "member_descriptor", (cls, name)
            monkeypatch.setattr(cls, name, _Recorder(name, inner, log, current))
    for label, entry in ENTRIES:
        orig = getattr(K, entry)

        def wrapped(*a: Any, _orig: Callable[..., Any] = orig, _label: str = label, **kw: Any) -> Any:
            current.append(_label)
            try:
                return _orig(*a, **kw)
            finally:
                current.pop()

        monkeypatch.setattr(K, entry, functools.wraps(orig)(wrapped))
    yield log


def _forwards() -> None:
    """Drive every entry point through the runtime's Mamba2 layer on the tiny model."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = NemotronH(cfg).eval()
    mixer = next(b.mixer for b in model.layers if isinstance(b.mixer, Mamba2Mixer))
    pool = StatePool.allocate(cfg, num_working=6, num_track=6, max_len=64, device=torch.device("cpu"),
                              dtype=torch.float32, verify_rows=4, verify_tokens=3)  # fmt: skip
    engine = {
        "mamba_track_mask_indices": torch.tensor([0]),
        "conv_states_mask_indices": torch.tensor([0]),
    }
    with torch.no_grad():
        # A mixed forward: two prefill rows with boundaries on and off the scan grid and at
        # a row's end, then two decode rows, one at a boundary.
        ext = [13, 9, 1, 1]
        hp = plan_host(
            extend_lens=ext, prefix_lens=[0, 5, 15, 6], slots=[0, 1, 2, 3], num_decodes=2,
            chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel, track_interval=cfg.chunk_size,
            track_mask=[True] * 4, track_slots=[6, 7, 8, 9],
        )  # fmt: skip
        md = hp.metadata(to_device_packed(hp.arrays, torch.device("cpu")), **engine)
        mixer.forward(torch.randn(sum(ext), cfg.hidden_size), Forward(md=md, pool=pool))
        K.track_save_from_metadata(md, pool.conv, pool.ssm)
        # A decode forward.
        track = {
            "mamba_track_indices": torch.tensor([6, -1]),
            "mamba_track_mask": torch.tensor([True, False]),
            "has_mamba_track_mask": True,
        }
        fwd = ForwardMetadata(query_start_loc=torch.arange(3), mamba_cache_indices=torch.tensor([0, 1]),
                              **track, **engine)  # type: ignore[arg-type]  # fmt: skip
        dmd = prepare_decode(fwd)
        mixer.forward(torch.randn(2, cfg.hidden_size), Forward(md=dmd, pool=pool))
        K.track_save_from_metadata(dmd, pool.conv, pool.ssm)
        # A verify forward of trees, then its commit.
        tree = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
        vfwd = ForwardMetadata(
            query_start_loc=torch.arange(3) * 3, mamba_cache_indices=torch.tensor([0, 1]),
            is_target_verify=True, draft_token_num=3, retrieve_parent_token=tree,
            retrieve_next_token=tree, retrieve_next_sibling=tree, **track, **engine,  # type: ignore[arg-type]
        )  # fmt: skip
        vmd = prepare_target_verify(vfwd)
        mixer.forward(torch.randn(6, cfg.hidden_size), Forward(md=vmd, pool=pool))
        cmd = SpecCommitMetadata.evolve_from(
            vmd, accepted_index=torch.tensor([2, 0]), track_token=torch.tensor([1, -1])
        )
        K.spec_commit_from_metadata(cmd, pool.conv, pool.ssm, *pool.verify_states(2, 3))


def field_table(log: dict[str, set[str]]) -> str:
    """Markdown table: one row per field (declaration order), one column per entry point."""
    labels = [label for label, _ in ENTRIES]
    head = "| field | role | " + " | ".join(labels) + " |"
    rule = "|---|---|" + "---|" * len(labels)
    lines = [head, rule]
    for spec in fields_of(SpecCommitMetadata):
        marks = " | ".join("x" if label in log.get(spec.name, ()) else "" for label in labels)
        lines.append(f"| `{spec.name}` | {spec.role.value} | {marks} |")
    return "\n".join(lines)


def test_every_field_is_read_by_an_entry_point_or_declared_engine_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _recording(monkeypatch) as log:
        _forwards()
    table = field_table(log)
    with capsys.disabled():
        print("\n" + table)
    unread = [s.name for s in fields_of(SpecCommitMetadata)
              if s.name not in log and s.role is not Role.ENGINE_ONLY]  # fmt: skip
    assert not unread, f"no Mamba2 entry point reads {unread}: wire them or declare Role.ENGINE_ONLY"
    misread = {s.name: sorted(log[s.name]) for s in fields_of(SpecCommitMetadata)
               if s.role is Role.ENGINE_ONLY and s.name in log}  # fmt: skip
    assert not misread, f"Role.ENGINE_ONLY fields read by Mamba2 entry points: {misread}"
    # every entry point ran and read something
    assert {e for reads in log.values() for e in reads} == {label for label, _ in ENTRIES}
    assert table in DOC.read_text(), "docs/fields.md is stale: paste the printed table"


def test_the_recorder_sees_a_read_and_charges_it_to_its_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    md = prepare_decode(
        ForwardMetadata(query_start_loc=torch.arange(2), mamba_cache_indices=torch.tensor([0]))
    )
    with _recording(monkeypatch) as log:
        _ = md.query_start_loc  # outside any entry point: not charged
        pool = torch.zeros(1, 2, 3, 2)
        K.track_save_from_metadata(md, pool, torch.zeros(1, 2, 1, 1, 1))
    assert log == {"is_target_verify": {"track save"}, "has_mamba_track_mask": {"track save"}}
