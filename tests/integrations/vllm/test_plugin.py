"""The plugin's entry point: opt-in, one-line version refusal, declared registration only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridmeta.integrations.vllm import plugin

# What vLLM's registries hold after vLLM loads its general plugins in a fresh process.
_PROBE = """
import json
import vllm.plugins
from vllm.model_executor.custom_op import op_registry_oot
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum, _MAMBA_ATTN_OVERRIDES
vllm.plugins.load_general_plugins()
print(json.dumps({
    "oot": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
    "mamba2": _MAMBA_ATTN_OVERRIDES.get(MambaAttentionBackendEnum.MAMBA2),
}))
"""


def _probe(**env: str) -> dict[str, object]:
    full = {k: v for k, v in os.environ.items() if k != plugin.ENABLE_ENV} | env
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_importing_the_integration_imports_no_engine() -> None:
    code = (
        "import sys, hybridmeta, hybridmeta.integrations.vllm, "
        "hybridmeta.integrations.vllm.metadata, hybridmeta.integrations.vllm.layer; "
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_an_untested_vllm_is_refused_in_one_line() -> None:
    with pytest.raises(RuntimeError) as err:
        plugin.check_vllm_version("0.33.0")
    msg = str(err.value)
    assert "\n" not in msg and "0.33.0" in msg and "0.32.0" in msg and plugin.ENABLE_ENV in msg
    assert plugin.check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"


def test_disabled_register_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    plugin.register()  # returns before importing anything of vLLM's
    assert not plugin._registered


def test_vllm_loads_the_plugin_only_when_enabled() -> None:
    pytest.importorskip("vllm", reason="needs the vLLM environment (make test-vllm)")
    off = _probe()
    assert "MambaMixer2" not in off["oot"]  # type: ignore[operator]
    assert off["mamba2"] is None
    on = _probe(**{plugin.ENABLE_ENV: "1"})
    assert on["oot"] == {"MambaMixer2": "hybridmeta.integrations.vllm.mixer.HybridMambaMixer2"}
    assert on["mamba2"] == "hybridmeta.integrations.vllm.backend.HybridMamba2Backend"
    # vLLM's own plugin selection also works: an allow-list without us leaves vLLM as is
    picked = _probe(**{plugin.ENABLE_ENV: "1", "VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert picked["mamba2"] is None
