"""Graph capture and replay behind one interface: real CUDA graphs and a CPU emulation.

A captured graph fixes three things: the storage every kernel reads and writes, every
Python value computed while capturing (slice bounds, branch decisions, scalars), and the
list of device operations. Replay re-issues exactly those operations on exactly that
storage. :class:`CudaGraphBackend` gets this from ``torch.cuda.CUDAGraph``;
:class:`EmulatedGraphBackend` reproduces it on any device (the CPU in CI) by recording
every dispatcher operation with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.
Calling the Python step again would not be faithful: it re-derives slices on every call and
hides exactly the stale-tail defect (sglang #32555) that the graph tests exist to catch.

Emulation rules (mirroring what a CUDA graph does):

* view ops are not re-run: the captured view objects already alias the captured storage;
* in-place and ``out=`` ops (schema argument annotated ``Tensor(a!)``, including
  ``torch.library`` custom ops that declare ``mutates_args``, e.g. wrapped Triton kernels)
  re-run on the same tensor objects, so they read the current contents of their inputs;
* out-of-place ops re-run and their result is copied into the tensor allocated at capture;
* allocations and metadata-only ops (``empty``, ``unsqueeze_``, ``resize_``) record no device work;
* anything that reads device values on the host during capture (``.item()``, ``bool(t)``,
  ``nonzero``, boolean-mask indexing, ``.tolist()``, ``.numpy()``) raises
  :class:`GraphCaptureError`, as CUDA stream capture does.

Kernels launched outside the dispatcher (a raw Triton launch not wrapped with
``torch.library``) are invisible to the emulation; wrap them as custom ops.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import gc
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CapturedGraph",
    "CudaGraphBackend",
    "EmulatedGraphBackend",
    "GraphBackend",
    "GraphCaptureError",
    "canonical_device",
    "default_backend",
]


def canonical_device(device: torch.device | str) -> torch.device:
    """``torch.device("cuda")`` names the current device: give it its index, so that it
    compares equal to the device of the tensors allocated on it (``cuda:0``)."""
    d = torch.device(device)
    index: int | None = d.index  # None for a bare "cuda" (torch's stubs say int)
    if d.type == "cuda" and index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


T = TypeVar("T")

_aten = torch.ops.aten


class GraphCaptureError(RuntimeError):
    """An operation that a CUDA graph cannot capture was attempted during capture."""


class CapturedGraph(abc.ABC, Generic[T]):
    """A captured step: ``outputs`` live in captured storage; ``replay()`` refills them."""

    def __init__(self, outputs: T) -> None:
        self.outputs = outputs

    @abc.abstractmethod
    def replay(self) -> None:
        """Re-issue the captured device work on the captured storage."""


class GraphBackend(abc.ABC):
    """Captures a zero-argument callable into a replayable graph.

    Parameters
    ----------
    device
        The device whose work is captured.
    """

    name: str = "abstract"

    def __init__(self, device: torch.device | str) -> None:
        self.device = canonical_device(device)

    @abc.abstractmethod
    def capture(self, fn: Callable[[], T], *, warmup: int = 1) -> CapturedGraph[T]:
        """Run ``fn`` ``warmup`` times eagerly, then capture one call of it.

        ``fn`` must read and write only tensors that outlive the graph (static buffers,
        state pools) or that it allocates itself; what it returns is the graph's output.
        """


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running inside a capture.

    An automatic collection can start at any allocation, so inside a capture it may free
    unreachable cycles left by earlier work: a ``torch.cuda.CUDAGraph`` (its destructor
    calls ``cudaGraphExecDestroy`` and releases its pool) or a Triton kernel (its module is
    unloaded). CUDA does not permit those calls while a stream is capturing: torch only
    warns, the capture is invalidated, and the *next* launch fails with "operation failed
    due to a previous error during capture", far from the cause. ``torch.cuda.graph``
    neither collects before capturing (unless ``torch.compiler.config.force_cudagraph_gc``)
    nor pauses the collector (read in torch 2.13's ``torch/cuda/graphs.py``), so a process that captures
    many graphs (a replay harness builds fresh graphs for every test case) hits this at
    random. The garbage waits for the first collection after the capture. A collector the
    caller had already disabled stays disabled.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- CUDA


class _CudaCaptured(CapturedGraph[T]):
    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: T) -> None:
        super().__init__(outputs)
        self._graph = graph

    def replay(self) -> None:
        self._graph.replay()


class CudaGraphBackend(GraphBackend):
    """Real CUDA graphs; all graphs of one backend share one memory pool.

    Capture the largest bucket first so smaller graphs reuse its pool memory.
    """

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaGraphBackend: device must be a CUDA device, got {self.device}")
        self._pool: Any = None

    def capture(self, fn: Callable[[], T], *, warmup: int = 1) -> CapturedGraph[T]:
        with torch.cuda.device(self.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # Warm-up on a side stream, as torch.cuda.graph requires (lazy init, workspaces).
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with _collector_paused(), torch.cuda.graph(graph, pool=self._pool):
                outputs = fn()
        return _CudaCaptured(graph, outputs)


# ---------------------------------------------------------------------- emulation


class _Kind(enum.Enum):
    SKIP = "skip"  # views, allocations, metadata-only ops: no device work to redo
    MUTATE = "mutate"  # in-place / out= ops: re-run on the same tensor objects
    FUNCTIONAL = "functional"  # re-run, copy the result into the captured output


# Ops whose output size or value is data-dependent: CUDA must sync to run them.
_SYNCING_OPS: frozenset[Any] = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.nonzero.default,
        _aten.nonzero.out,
        _aten.masked_select.default,
        _aten.masked_select.out,
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.repeat_interleave.Tensor,
        _aten.bincount.default,
    }
)

# Ops that return host values computed from tensor metadata only (no device read).
_HOST_METADATA_OPS: frozenset[Any] = frozenset(
    {
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.is_same_size.default,
    }
)

_ALLOC_OPS: frozenset[Any] = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten.resize_.default,
    }
)

_STORAGE_SWAP_OPS: frozenset[Any] = frozenset(
    {
        _aten.set_.source_Storage,
        _aten.set_.source_Storage_storage_offset,
        _aten.set_.source_Tensor,
        _aten.set_.default,
    }
)

# Host-reading tensor methods that bypass the dispatcher.
_HOST_READ_METHODS = ("tolist", "numpy", "__array__")


def _classify(func: Any) -> _Kind:
    schema = func._schema
    if func in _ALLOC_OPS or torch.Tag.inplace_view in func.tags:
        return _Kind.SKIP
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return _Kind.MUTATE
    if func.is_view or any(r.alias_info is not None for r in schema.returns):
        return _Kind.SKIP
    return _Kind.FUNCTIONAL


def _returns_host_value(func: Any) -> bool:
    for ret in func._schema.returns:
        t = ret.type
        if isinstance(t, torch.OptionalType):
            t = t.getElementType()
        if isinstance(t, torch.ListType):
            t = t.getElementType()
        if not isinstance(t, torch.TensorType):
            return True
    return False


def _reads_a_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # A host value computed from host arguments alone (torch.promote_types of two dtypes)
    # reads no device memory.
    def has(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return True
        if isinstance(x, (list, tuple)):
            return any(has(v) for v in x)
        return False

    return has(args) or has(tuple(kwargs.values()))


def _has_bool_index(func: Any, args: tuple[Any, ...]) -> bool:
    # x[mask] and x[mask] = values run nonzero inside the kernel: a hidden sync on CUDA.
    # x[mask] = one value is a masked fill inside index_put_ (no sync): CUDA captures it.
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    if func is not _aten.index.Tensor and len(args) > 2:
        values = args[2]
        if isinstance(values, torch.Tensor) and values.numel() == 1 and len(args[1]) == 1:
            return False
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    )


def _is_self_equal(func: Any, args: tuple[Any, ...]) -> bool:
    # torch.equal(t, t) answers from the tensors' metadata (same storage, sizes, strides)
    # without reading a value: CUDA captures it.
    if func is not _aten.equal.default or len(args) < 2:
        return False
    a, b = args[0], args[1]
    return bool(
        a.is_set_to(b) if a.shape == b.shape and a.stride() == b.stride() else False
    )


_BOOL_INDEX_OPS: frozenset[Any] = frozenset(
    {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default}
)


def _is_device_to_host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is _aten._to_copy.default:
        dst = kwargs.get("device")
        return dst is not None and torch.device(dst).type == "cpu" and args[0].device.type != "cpu"
    if func is _aten.copy_.default:
        return bool(args[0].device.type == "cpu" and args[1].device.type != "cpu")
    return False


def _freeze(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.as_strided(x.size(), x.stride(), x.storage_offset())
    if isinstance(x, tuple):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, list):
        return [_freeze(v) for v in x]
    if isinstance(x, dict):
        return {k: _freeze(v) for k, v in x.items()}
    return x


class _Op:
    __slots__ = ("args", "func", "kind", "kwargs", "out")

    def __init__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, kind: _Kind
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.out = out
        self.kind = kind


def _sync_error(what: str) -> GraphCaptureError:
    return GraphCaptureError(
        f"{what} reads device values on the host (a device->host sync) during graph capture; "
        "CUDA stream capture fails on this ('operation not permitted when stream is "
        "capturing'). Decide it from host-side data before capture, or keep it on the device."
    )


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every dispatcher op issued while active, refusing host reads."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[_Op] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _is_self_equal(func, args):
            return func(*args, **kwargs)  # no device work, nothing to record
        if func in _SYNCING_OPS:
            raise _sync_error(str(func))
        if func in _STORAGE_SWAP_OPS:
            raise GraphCaptureError(
                f"{func} swaps a tensor's storage during capture; a graph fixes storage"
            )
        if func in _BOOL_INDEX_OPS and _has_bool_index(func, args):
            raise _sync_error(f"{func} with a boolean mask index")
        if (
            func not in _HOST_METADATA_OPS
            and _returns_host_value(func)
            and _reads_a_tensor(args, kwargs)
        ):
            raise _sync_error(str(func))
        if _is_device_to_host_copy(func, args, kwargs):
            raise _sync_error(f"{func} to the CPU")
        out = func(*args, **kwargs)
        kind = _classify(func)
        if kind is not _Kind.SKIP:
            # Freeze each tensor's size/stride/offset as seen now: a later in-place metadata
            # op (unsqueeze_, t_) must not change what replay reads, as in a CUDA graph.
            self.ops.append(_Op(func, _freeze(args), _freeze(kwargs), _freeze(out), kind))
        return out


@contextlib.contextmanager
def _forbid_host_reads() -> Iterator[None]:
    # These methods copy tensor data to the host without going through the dispatcher.
    saved: dict[str, Any] = {}

    def _make(name: str) -> Callable[..., Any]:
        def _refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise _sync_error(f"Tensor.{name}()")

        return _refuse

    for name in _HOST_READ_METHODS:
        if name in torch.Tensor.__dict__:
            saved[name] = torch.Tensor.__dict__[name]
        setattr(torch.Tensor, name, _make(name))
    try:
        yield
    finally:
        for name in _HOST_READ_METHODS:
            if name in saved:
                setattr(torch.Tensor, name, saved[name])
            else:
                delattr(torch.Tensor, name)


def _copy_into(captured: Any, fresh: Any, func: Any) -> None:
    if isinstance(captured, torch.Tensor):
        if captured.shape != fresh.shape or captured.dtype != fresh.dtype:
            raise GraphCaptureError(
                f"replay of {func} produced {tuple(fresh.shape)}/{fresh.dtype}, captured "
                f"{tuple(captured.shape)}/{captured.dtype}"
            )
        captured.copy_(fresh)
    elif isinstance(captured, (tuple, list)):
        for c, f in zip(captured, fresh, strict=True):
            _copy_into(c, f, func)


class _EmulatedCaptured(CapturedGraph[T]):
    def __init__(self, ops: list[_Op], outputs: T) -> None:
        super().__init__(outputs)
        # Only ops with device work are recorded; their frozen aliases keep storage alive.
        self._ops = ops

    @property
    def num_ops(self) -> int:
        """Number of device operations re-issued per replay."""
        return len(self._ops)

    def replay(self) -> None:
        for op in self._ops:
            fresh = op.func(*op.args, **op.kwargs)
            if op.kind is _Kind.FUNCTIONAL:
                _copy_into(op.out, fresh, op.func)


class EmulatedGraphBackend(GraphBackend):
    """CUDA-graph semantics without CUDA: records dispatcher ops, replays them in place.

    Works on any device; used on the CPU so graph tests run in CI. Capture executes the
    recorded ops once (CUDA capture does not), so capture with metadata whose rows are all
    padding, as :class:`~hybridmeta.graphs.runner.GraphRunner` does.
    """

    name = "emulated"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)

    def capture(self, fn: Callable[[], T], *, warmup: int = 1) -> CapturedGraph[T]:
        for _ in range(warmup):
            fn()
        recorder = _Recorder()
        # Paused as on CUDA, so that finalizers behave the same under both backends.
        with _collector_paused(), _forbid_host_reads(), recorder:
            outputs = fn()
        return _EmulatedCaptured(recorder.ops, outputs)


def default_backend(device: torch.device | str) -> GraphBackend:
    """Real CUDA graphs on a CUDA device, the emulation elsewhere."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaGraphBackend(dev)
    return EmulatedGraphBackend(dev)
