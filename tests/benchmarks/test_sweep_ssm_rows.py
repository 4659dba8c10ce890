"""benchmarks/sweep_ssm_rows.py runs end to end in its smoke mode (tiny shapes, the CPU
interpreter) and writes the figures the GPU run is read for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.interpreter
def test_sweep_smoke_writes_every_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kernels  # type: ignore[import-not-found, unused-ignore]
    import sweep_ssm_rows  # type: ignore[import-not-found, unused-ignore]

    # smoke mode rewrites bench_kernels' shapes and device: restore them afterwards
    for name in ("H", "P", "N", "G", "CONV_DIM", "LAYERS", "HIDDEN", "DEV", "BS_LIST",
                 "SWEEP_BS", "MIXER_BS", "NORM_BS", "FUSED_TRACK_BS", "PAD_BUCKET",
                 "TRACK_CASES"):  # fmt: skip
        monkeypatch.setattr(bench_kernels, name, getattr(bench_kernels, name))
    argv = ["--smoke", "--out", str(tmp_path), "--tag", "t", "--rows", "1,4", "--bs", "1,3",
            "--warps-bf16", "2", "--warps-fp32", "1"]  # fmt: skip
    assert sweep_ssm_rows.main(argv) == 0
    res = json.loads((tmp_path / "sweep_ssm_rows_t.json").read_text())
    assert {"device", "torch", "triton", "date_utc", "copy_ceiling_tbps"} <= set(res)
    seen = {(c["state_dtype"], c["tile_rows"], c["max_regs"]) for c in res["configs"]}
    # one row and four rows a program, and four rows capped, per state dtype
    assert seen == {(d, r, m) for d in ("bfloat16", "float32") for r, m in
                    ((1, None), (4, None), (4, 64))}  # fmt: skip
    for c in res["configs"]:
        assert set(c["bs"]) == {"1", "3"} and all("us" in e for e in c["bs"].values())
        pad = c["padding"]
        assert pad["pad_rows_zero"] and pad["over_bucket1_one_row"] > 0
        assert c["check"]["matches_reference"] and c["check"]["pad_rows_zero"]
    sys.modules.pop("sweep_ssm_rows", None)
