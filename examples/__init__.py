"""Worked examples of :mod:`hybridmeta.testing` (run by ``tests/examples/``)."""
