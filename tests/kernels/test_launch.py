"""The direct launcher: one normal launch per variant key, then the compiled launcher."""

from __future__ import annotations

import types
from typing import Any, ClassVar

import pytest
import torch

from hybridmeta.kernels import _launch
from hybridmeta.kernels._launch import DirectLauncher, device_capacity


class _Compiled:
    """Stands in for Triton's CompiledKernel: records the launcher calls."""

    def __init__(self, launcher: Any = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.launcher = launcher
        self.function = 1234
        self.packed_metadata = (1, 1, 0)
        self.metadata = types.SimpleNamespace(num_warps=1, shared=0)
        self.n_regs = 40

    @property
    def run(self) -> Any:
        if self.launcher is not None:
            return self.launcher
        return lambda *args: self.calls.append(args)


class _Kernel:
    device_caches: ClassVar[dict[Any, Any]] = {}


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device 0 is current, its stream is 77, and it has an H100/H200's SM limits."""
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 77, raising=False)
    monkeypatch.setitem(_launch._PROPS, 0, (132, 2048, 65536, 228 * 1024))


def _launch_once(
    lau: DirectLauncher, comp: _Compiled, slow_calls: list[Any], *, aligned: bool = True
) -> None:
    def slow(grid: tuple[int, int, int]) -> object:
        slow_calls.append(grid)
        return comp

    key = ("k", 0)
    var = lau.lookup(key, aligned)
    lau.launch(var, (5, 2, 1), key, 0, aligned, lambda: (111, None, 3), slow)


@pytest.mark.usefixtures("fake_gpu")
def test_first_call_is_normal_then_direct() -> None:
    lau, comp, slow = DirectLauncher(_Kernel()), _Compiled(), []  # type: ignore[var-annotated]
    _launch_once(lau, comp, slow)
    assert slow == [(5, 2, 1)] and comp.calls == []
    _launch_once(lau, comp, slow)
    _launch_once(lau, comp, slow)
    assert slow == [(5, 2, 1)]
    # grid, stream, function, metadata, no launch metadata or hooks, then the arguments
    assert comp.calls == [(5, 2, 1, 77, 1234, (1, 1, 0), None, None, None, 111, None, 3)] * 2
    var = lau.lookup(("k", 0), True)
    assert var is not None
    # 40 registers -> 48 per thread allocated -> 42 one-warp programs by registers, 32 cap.
    assert var.capacity == 132 * 32


class _Launcher:
    """Triton 3.6's CudaLauncher: a Python wrapper around the generated C ``launch``."""

    def __init__(self, scratch: int) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def launch(self, *args: Any) -> None:
        self.calls.append(("c", *args))

    def __call__(self, *args: Any) -> None:
        self.calls.append(("py", *args))


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("scratch", [0, 64])
def test_c_launcher_is_called_directly_unless_scratch_is_needed(scratch: int) -> None:
    launcher = _Launcher(scratch)
    lau, comp, slow = DirectLauncher(_Kernel()), _Compiled(launcher), []  # type: ignore[var-annotated]
    _launch_once(lau, comp, slow)
    _launch_once(lau, comp, slow)
    want: tuple[Any, ...]
    if scratch == 0:
        # grid, stream, function, cooperative, pdl, no scratch, metadata, hooks, arguments
        want = ("c", 5, 2, 1, 77, 1234, False, True, None, None, (1, 1, 0), None, None, None)
    else:
        want = ("py", 5, 2, 1, 77, 1234, (1, 1, 0), None, None, None)
    assert launcher.calls == [(*want, 111, None, 3)]


@pytest.mark.usefixtures("fake_gpu")
def test_unaligned_pointers_and_hooks_take_the_normal_path(monkeypatch: pytest.MonkeyPatch) -> None:
    lau, comp, slow = DirectLauncher(_Kernel()), _Compiled(), []  # type: ignore[var-annotated]
    _launch_once(lau, comp, slow, aligned=False)
    _launch_once(lau, comp, slow, aligned=False)
    assert len(slow) == 2 and lau.lookup(("k", 0), True) is None
    _launch_once(lau, comp, slow)  # caches
    monkeypatch.setattr(_launch, "_launch_hook_set", lambda: True)
    _launch_once(lau, comp, slow)
    assert len(slow) == 4 and comp.calls == []


def test_interpreted_kernels_are_never_cached() -> None:
    lau, slow = DirectLauncher(object()), []
    for _ in range(2):
        lau.launch(None, (1, 1, 1), "k", -1, True, lambda: (), lambda g: slow.append(g))
    assert len(slow) == 2 and lau.lookup("k", True) is None


@pytest.mark.usefixtures("fake_gpu")
def test_capacity_follows_registers_warps_and_shared_memory() -> None:
    assert device_capacity(0, 1, 32, 0) == 132 * 32  # the 32-blocks-per-SM cap
    assert device_capacity(0, 1, 128, 0) == 132 * 16  # 4096 registers per warp
    assert device_capacity(0, 4, 64, 0) == 132 * 8  # 2048 registers a warp, 4 warps
    assert device_capacity(0, 8, 32, 0) == 132 * 8  # 64 warps per SM
    assert device_capacity(0, 1, 32, 64 * 1024) == 132 * 3  # shared memory
    assert device_capacity(-1, 1, 32, 0) == 1
