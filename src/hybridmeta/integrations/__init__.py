"""Where hybridmeta plugs into inference engines: one package per engine.

* :mod:`hybridmeta.integrations.vllm`: a vLLM general plugin that serves every
  ``MambaMixer2`` model through hybridmeta's metadata and ops (``docs/vllm.md``).

Importing this package imports no engine and changes nothing.
"""
