"""Fixtures of the runtime tests: the tiny checkpoint on disk and the model loaded from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-nemotron-h"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path) -> NemotronH:
    return load_nemotron_h(tiny_dir)
