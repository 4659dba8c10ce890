"""Reference hybrid runtime: Nemotron-H loader, pure-torch model, step loop and main job.

Quick use::

    from hybridmeta.runtime import Runtime, RuntimeOptions, load_nemotron_h

    model = load_nemotron_h("/path/to/checkpoint", device="cuda", dtype=torch.bfloat16)
    rt = Runtime(model, RuntimeOptions(num_working=8, track_interval=256))
    rid = rt.submit(prompt_ids, max_new_tokens=64)
    finished = rt.run()[rid]          # tokens, per-token log-probs, cached prompt tokens

``python -m hybridmeta.runtime`` (or :func:`main_job`) runs the end-to-end check.
"""

from hybridmeta.runtime.config import ConfigError, NemotronHConfig, read_config
from hybridmeta.runtime.engine import (
    Finished,
    Runtime,
    RuntimeOptions,
    StepStats,
    cold_logits,
)
from hybridmeta.runtime.job import kl_per_position, main_job
from hybridmeta.runtime.loader import CheckpointError, load_nemotron_h
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.state import OutOfSlotsError, StatePool
from hybridmeta.runtime.tiny import tiny_config, write_tiny_checkpoint

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Finished",
    "NemotronH",
    "NemotronHConfig",
    "OutOfSlotsError",
    "Runtime",
    "RuntimeOptions",
    "StatePool",
    "StepStats",
    "cold_logits",
    "kl_per_position",
    "load_nemotron_h",
    "main_job",
    "read_config",
    "tiny_config",
    "write_tiny_checkpoint",
]
