"""Fixtures of the runtime tests: the tiny checkpoint on disk and the model loaded from it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import Mamba2Mixer, NemotronH
from hybridmeta.runtime.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-nemotron-h"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> NemotronH:
    return load_nemotron_h(tiny_dir)


@pytest.fixture(scope="session")
def floored_dt_model(tiny_model: NemotronH) -> NemotronH:
    """The tiny model with every dt bias at -12: ``softplus(dt - 12) ~ 6e-6`` lies below the
    model's ``time_step_min`` (1e-3), so the dt floor binds for every head and token."""
    model = copy.deepcopy(tiny_model)
    assert model.config.time_step_min == 1e-3
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                m.dt_bias.fill_(-12.0)
                m.derive_constants()
    return model
