"""Prefill path: mixed-batch planner, chunked SSD scan, prefill conv, track-save, oracle.

Public API (documented in ``docs/prefill.md``)::

    plan = plan_mixed_batch(extend_lens=..., prefix_lens=..., slots=..., num_decodes=...,
                            chunk_size=..., conv_kernel=..., track_interval=...,
                            track_mask=..., track_slots=..., device=...)
    conv = causal_conv1d_prefill(xbc, w, b, plan=plan, conv_state=conv_pool)
    x, B, C = split_xbc(conv.out, nheads, headdim, ngroups, dstate)
    scan = ssd_chunked_scan(x, dt, B, C, params=params, plan=plan, ssm_state=ssm_pool)
    # or ssd_chunked_scan_triton(...) with the same contract
    extend_track_save(plan, xbc=xbc, conv=conv, scan=scan,
                      conv_state=conv_pool, ssm_state=ssm_pool)
"""

from hybridmeta.prefill.conv import ConvPrefillOutput, causal_conv1d_prefill
from hybridmeta.prefill.oracle import SSMParams, split_xbc
from hybridmeta.prefill.planner import PrefillPlan, TrackPlan, plan_mixed_batch
from hybridmeta.prefill.scan import SSDScanOutput, ssd_chunked_scan
from hybridmeta.prefill.track import extend_track_save
from hybridmeta.prefill.triton_scan import ssd_chunked_scan_triton

__all__ = [
    "ConvPrefillOutput",
    "PrefillPlan",
    "SSDScanOutput",
    "SSMParams",
    "TrackPlan",
    "causal_conv1d_prefill",
    "extend_track_save",
    "plan_mixed_batch",
    "split_xbc",
    "ssd_chunked_scan",
    "ssd_chunked_scan_triton",
]
