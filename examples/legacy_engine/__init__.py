"""A small "legacy engine": a Mamba2-like decode backend in plain torch with its own
dataclass metadata, the way engines write it today. It imports nothing from hybridmeta.

* :mod:`.metadata`: ``ForwardMetadata`` and ``Mamba2Metadata`` dataclasses and two
  hand-written constructors: ``prepare_decode_dropping`` (seed defect 2: forgets
  ``has_mamba_track_mask``, which silently defaults to ``False``) and ``prepare_decode``
  (fixed: copies every field).
* :mod:`.engine`: the decode layer, its static CUDA-graph buffers and the graph runner's
  refresh. ``hand_whole_track_buffer=True`` reproduces seed defect 1: the runner hands the
  whole ``max_bs`` track buffer to the track-save, which takes its last ``num_decodes``
  rows, rows a small bucket never refreshed.
* :mod:`.harness`: the few lines that wrap the engine for :func:`hybridmeta.testing.check_replay`.
"""
