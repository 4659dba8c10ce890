"""``hybridmeta audit`` on the current sglang and vLLM Mamba2 metadata modules.

Downloads the released wheels (``pip download --no-deps``) into the git-ignored
``third_party/`` folder, extracts the Mamba2 metadata modules, audits them (static: the
engines are never imported) and writes ``audit_engines.json`` and ``audit_engines.md``
into ``--out``. Every finding is matched against a verdict checked by hand (reading the
engine's code: which class the call builds, from what, and who reads the dropped field);
a finding with no recorded verdict is reported as ``unchecked``.

    python benchmarks/audit_engines.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import hybridmeta
from hybridmeta.audit import audit_paths

ROOT = Path(__file__).resolve().parents[1]

#: What is audited: (label, engine package, modules inside its wheel). The Mamba2 metadata
#: modules of each engine, and sglang's ForwardBatch with the ScheduleBatch it is built
#: from (ForwardBatch.init_new constructs, then assigns further fields).
AUDITS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sglang", "sglang", ("sglang/srt/layers/attention/mamba/mamba2_metadata.py",)),
    (
        "sglang-forward-batch",
        "sglang",
        (
            "sglang/srt/model_executor/forward_batch_info.py",
            "sglang/srt/managers/schedule_batch.py",
        ),
    ),
    (
        "vllm",
        "vllm",
        (
            "vllm/v1/attention/backends/mamba2_attn.py",
            "vllm/v1/attention/backends/mamba_attn.py",
        ),
    ),
)

_GDN_KDA = "read only by the GDN/KDA backends from their own ForwardMetadata; no Mamba2 reader"
#: Hand-checked verdicts, by (engine, field): (claim correct?, impact, why).
VERDICTS: dict[tuple[str, str], tuple[bool, str, str]] = {
    ("sglang", "conv_block_table"): (True, "latent", f"{_GDN_KDA} (gdn_backend, kda_prefill_graph)"),
    ("sglang", "logical_num_tokens"): (True, "latent", f"{_GDN_KDA} (kda_backend)"),
    ("sglang", "mamba_cache_indices_gdn"): (True, "latent", f"{_GDN_KDA} (ascend_gdn_backend)"),
    ("sglang", "replayssm_write_pos"): (True, "latent", f"{_GDN_KDA} (gdn_backend ReplaySSM)"),
    ("sglang", "replayssm_force_flush"): (True, "latent", f"{_GDN_KDA} (gdn_backend ReplaySSM)"),
    ("sglang", "track_chunk_idx"): (True, "latent", f"{_GDN_KDA} (gdn_backend, kda_backend)"),
    ("sglang", "track_ssm_h_batch_src"): (
        True, "latent",
        "read by MambaAttnBackendBase._track_mamba_state_extend only when h_track_buf is "
        "given (GDN/KDA); Mamba2AttnBackend.forward passes none",
    ),
    ("sglang", "state_checkpoint_cu_starts"): (True, "latent", f"{_GDN_KDA} (gdn/kda prefill)"),
    ("sglang", "num_state_checkpoints"): (True, "latent", f"{_GDN_KDA} (gdn/kda prefill)"),
    ("sglang", "state_checkpoint_every_n_tokens"): (True, "latent", f"{_GDN_KDA} (gdn/kda prefill)"),
    ("sglang", "state_checkpoint_indices"): (True, "latent", f"{_GDN_KDA} (kda prefill)"),
    ("sglang", "fused_accept_state_indices"): (True, "latent", f"{_GDN_KDA} (kda_backend)"),
    ("sglang", "fused_accept_num_accepted"): (True, "latent", f"{_GDN_KDA} (kda_backend)"),
    ("sglang", "mamba_track_mask_indices"): (
        True, "latent",
        "dropped by prepare_decode (prepare_mixed recomputes it); the Mamba2 decode path "
        "reads forward_batch.mamba_track_mask instead",
    ),
    ("sglang", "conv_states_mask_indices"): (
        True, "latent",
        "dropped by prepare_decode (prepare_mixed recomputes it); MambaMixer2 reads it only "
        "in its prefill branch, which decode-only metadata never enters",
    ),
    ("sglang-forward-batch", "split_index"): (
        True, "latent",
        "ForwardBatch.init_new does not pass ScheduleBatch.split_index (default 0); its one "
        "split-prefill caller (TpModelWorker.forward_batch_split_prefill) calls it only "
        "while batch.split_index == 0, and ModelRunner.forward_split_prefill advances it",
    ),
}  # fmt: skip

#: Hand-checked verdicts for every finding of one function, by (label, function).
FUNCTION_VERDICTS: dict[tuple[str, str], tuple[bool, str, str]] = {
    ("sglang-forward-batch", "ScheduleBatch.copy"): (
        True, "none",
        "ScheduleBatch.copy deliberately keeps only the fields process_batch_result reads "
        "(its own comment says so); the rest take their defaults by design",
    ),
}  # fmt: skip


def _download(package: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "-q", "-d", str(dest), package],
        check=True,
    )  # fmt: skip
    wheels = sorted(dest.glob(f"{package}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise SystemExit(f"audit_engines: no {package} wheel in {dest} after pip download")
    return wheels[-1]


def _extract(wheel: Path, members: tuple[str, ...], dest: Path) -> list[Path]:
    out = []
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for m in members:
            if m not in names:
                # The module moved: find it by file name.
                hits = [n for n in names if n.endswith("/" + m.rsplit("/", 1)[-1])]
                if len(hits) != 1:
                    raise SystemExit(f"audit_engines: {m} not found in {wheel.name}")
                m = hits[0]
            zf.extract(m, dest)
            out.append(dest / m)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--third-party", type=Path, default=ROOT / "third_party")
    args = p.parse_args(argv)
    engines: list[dict[str, Any]] = []
    wheels: dict[str, Path] = {}
    for label, package, members in AUDITS:
        if package not in wheels:
            wheels[package] = _download(package, args.third_party)
        wheel = wheels[package]
        version = wheel.name.split("-")[1]
        files = _extract(wheel, members, args.third_party / f"{package}-{version}")
        t0 = time.perf_counter()
        result = audit_paths([str(f) for f in files])
        seconds = time.perf_counter() - t0
        findings = []
        for f in result.findings:
            verdict = VERDICTS.get((label, f.field)) or FUNCTION_VERDICTS.get((label, f.function))
            rel = Path(f.path).relative_to(args.third_party / f"{package}-{version}")
            findings.append({
                "file": str(rel), "line": f.line, "rule": f.rule, "function": f.function,
                "derived": f.derived, "source": f.source, "field": f.field,
                "default": f.default,
                "verdict": "unchecked" if verdict is None else
                           "true positive" if verdict[0] else "false positive",
                "impact": None if verdict is None else verdict[1],
                "why": None if verdict is None else verdict[2],
            })  # fmt: skip
        engines.append({
            "engine": label, "package": package, "version": version, "wheel": wheel.name,
            "files": [str(m) for m in members], "classes": result.classes,
            "calls_checked": result.calls_checked, "calls_skipped": result.calls_skipped,
            "audit_seconds": round(seconds, 4),
            "findings": findings,
            "true_positives": sum(f["verdict"] == "true positive" for f in findings),
            "false_positives": sum(f["verdict"] == "false positive" for f in findings),
            "unchecked": sum(f["verdict"] == "unchecked" for f in findings),
            "notes": [n.replace(str(args.third_party) + "/", "") for n in result.notes],
        })  # fmt: skip
    report = {
        "benchmark": "audit_engines",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (static analysis)",
        "python": platform.python_version(),
        "hybridmeta": hybridmeta.__version__,
        "engines": engines,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "audit_engines.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "audit_engines.md").write_text(_markdown(report))
    for e in engines:
        print(
            f"{e['engine']} {e['version']}: {len(e['findings'])} finding(s) in "
            f"{e['calls_checked']} call(s); {e['true_positives']} true, "
            f"{e['false_positives']} false, {e['unchecked']} unchecked"
        )
    return 1 if any(e["unchecked"] for e in engines) else 0


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# `hybridmeta audit` on the engines' Mamba2 metadata modules",
        "",
        f"Run {report['date']} by `benchmarks/audit_engines.py` (hybridmeta "
        f"{report['hybridmeta']}). Verdicts checked by hand against the engine's code: "
        "*true positive* means the field really is not passed and silently takes its "
        "default; *impact* says whether anything reads it from the built object today.",
        "",
    ]
    for e in report["engines"]:
        lines += [
            f"## {e['engine']} ({e['package']} {e['version']})",
            "",
            f"Files: {', '.join('`' + f + '`' for f in e['files'])}. "
            f"{e['calls_checked']} constructor call(s) checked ({e['calls_skipped']} skipped, "
            f"see the notes), {len(e['findings'])} "
            f"finding(s): {e['true_positives']} true positive(s), {e['false_positives']} "
            f"false positive(s), {e['unchecked']} unchecked.",
            "",
        ]
        if e["findings"]:
            lines += ["| file:line | function | field (default) | verdict | impact: why |",
                      "| --- | --- | --- | --- | --- |"]  # fmt: skip
            for f in e["findings"]:
                lines.append(
                    f"| `{f['file']}:{f['line']}` | `{f['function']}` | `{f['field']}` "
                    f"(`{f['default']}`) | {f['verdict']} | {f['impact']}: {f['why']} |"
                )
            lines.append("")
        for n in e["notes"]:
            lines.append(f"- note: {n}")
        if e["notes"]:
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
