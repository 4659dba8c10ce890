"""Static CUDA-graph buffers, the capture/replay runner, and the CPU graph emulation."""

from hybridmeta.graphs.buffers import (
    Bucket,
    InputSpec,
    StaticBuffers,
    bucket_for,
    default_buckets,
)
from hybridmeta.graphs.capture import (
    CapturedGraph,
    CudaGraphBackend,
    EmulatedGraphBackend,
    GraphBackend,
    GraphCaptureError,
    default_backend,
)
from hybridmeta.graphs.runner import GraphRunner, StepFn

__all__ = [
    "Bucket",
    "CapturedGraph",
    "CudaGraphBackend",
    "EmulatedGraphBackend",
    "GraphBackend",
    "GraphCaptureError",
    "GraphRunner",
    "InputSpec",
    "StaticBuffers",
    "StepFn",
    "bucket_for",
    "default_backend",
    "default_buckets",
]
