"""hybridmeta inside vLLM: a general plugin, opt-in, through vLLM's declared extension points.

Install with the ``vllm`` extra; enable with ``HYBRIDMETA_VLLM=1`` in the environment of
the vLLM process (``docs/vllm.md``). Without it the plugin's entry point returns at once
and vLLM runs unchanged. Importing this package imports neither vLLM nor the modules
that do (``backend``, ``mixer``, loaded by :func:`plugin.register` only).

Modules, one per extension point:

* :mod:`~hybridmeta.integrations.vllm.plugin`: the ``vllm.general_plugins`` entry point
  (opt-in switch, version check, registration).
* :mod:`~hybridmeta.integrations.vllm.backend`: the Mamba2 attention backend and its
  metadata builder (``register_backend(MambaAttentionBackendEnum.MAMBA2, ...)``).
* :mod:`~hybridmeta.integrations.vllm.mixer`: the ``MambaMixer2`` replacement
  (``PluggableLayer.register_oot(name="MambaMixer2")``).
* :mod:`~hybridmeta.integrations.vllm.metadata`: the declared description of what vLLM
  hands the builder and its one translation into ``Mamba2Metadata`` (no vLLM import).
"""

from hybridmeta.integrations.vllm.plugin import (
    ENABLE_ENV,
    SUPPORTED_VLLM_VERSIONS,
    check_vllm_version,
    enabled,
    register,
)

__all__ = ["ENABLE_ENV", "SUPPORTED_VLLM_VERSIONS", "check_vllm_version", "enabled", "register"]
