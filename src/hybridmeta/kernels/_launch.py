"""Cheap Triton launches: a compiled kernel called through its own launcher, directly.

``kernel[grid](*args)`` re-derives the compiled variant on every call in Triton 3.6: it
binds the arguments, specialises each one, hashes a key and looks the kernel up; the
generated C launcher then calls ``data_ptr()`` and asks the driver
(``cuPointerGetAttribute``) about every tensor argument. For the 40-argument SSM update
that is tens of microseconds of host time per launch (more than the kernel at small bs).

:class:`DirectLauncher` does that work once per *variant key*. The key is chosen by the
caller and must pin everything Triton specialises on: pointer dtypes, which optional
pointers are ``None``, every specialised integer argument (its value, so the ``== 1`` and
``% 16`` specialisations cannot differ), constexprs and launch options. Tensor alignment
is the one property the key leaves out: a call is *direct* only when every tensor pointer
is 16-byte aligned (the variant Triton picks for aligned tensors); anything else goes
through ``kernel[grid]`` every time. The first call of a key also goes through
``kernel[grid]``, which compiles (or finds) the variant and returns it; later calls pass
raw device addresses (plain ints: the launcher then skips ``data_ptr()`` and the driver
query) to that variant's launcher on the current stream.

Under the Triton interpreter (no CUDA), with a launch hook installed (profilers), or when
the tensors live on another device than the current one, every call takes the normal path.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["DirectLauncher", "device_capacity"]


class _Variant:
    """What a direct launch needs from one compiled variant."""

    __slots__ = (
        "c_launch", "capacity", "compiled", "coop", "function", "meta", "n_regs", "n_spills",
        "pdl", "run",
    )  # fmt: skip

    def __init__(self, compiled: Any, device_index: int) -> None:
        # ``function`` is a raw handle into the compiled module: hold the compiled kernel so
        # that the module stays loaded for as long as the handle may be launched.
        self.compiled: Any = compiled
        run = compiled.run  # initialises the handles on first access
        self.run: Callable[..., Any] = run
        self.function: int = compiled.function
        self.meta: Any = compiled.packed_metadata
        md = compiled.metadata
        #: registers per thread and spilled registers (benchmarks report them)
        self.n_regs: int = int(getattr(compiled, "n_regs", 0) or 0)
        self.n_spills: int = int(getattr(compiled, "n_spills", 0) or 0)
        #: programs of this variant that fit on the device at once
        self.capacity: int = device_capacity(
            device_index,
            int(getattr(md, "num_warps", 1) or 1),
            int(getattr(compiled, "n_regs", 0) or 0),
            int(getattr(md, "shared", 0) or 0),
        )
        # Triton 3.6's launcher object is a Python wrapper around the generated C function
        # that only allocates scratch memory: call the C function itself when the kernel
        # needs none (saves a Python frame and two closures per launch).
        c_launch = getattr(run, "launch", None)
        plain = (
            getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
        )
        self.c_launch: Callable[..., Any] | None = c_launch if plain else None
        self.coop: Any = getattr(run, "launch_cooperative_grid", False)
        self.pdl: Any = getattr(run, "launch_pdl", False)


def _usable(compiled: object) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "metadata"))


def _runtime_knobs() -> Any:
    try:
        from triton import knobs  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - a Triton without knobs: never launch directly
        return None
    return knobs.runtime


_KNOBS = _runtime_knobs()


def _launch_hook_set() -> bool:
    """Whether a launch hook (a profiler) is installed: those calls take the normal path."""
    if _KNOBS is None:
        return True
    for hook in (_KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook):
        # Triton 3.6 keeps a (possibly empty) HookChain; older versions None or a function.
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class DirectLauncher:
    """Launch one ``triton.jit`` kernel, directly once its variant for a key is known.

    Parameters
    ----------
    kernel
        The ``@triton.jit`` function.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._variants: dict[Hashable, _Variant] = {}
        # Interpreted kernels (TRITON_INTERPRET=1) have no compiled variants.
        self._compiled = hasattr(kernel, "device_caches")

    def clear(self) -> None:
        """Forget every cached variant (the next call of each key compiles or looks up)."""
        self._variants.clear()

    def lookup(self, key: Hashable, aligned: bool) -> _Variant | None:
        """The cached variant of ``key``; ``None`` before its first call or when a tensor
        pointer is not 16-byte aligned (such calls always take the normal path)."""
        return self._variants.get(key) if aligned else None

    def launch(
        self,
        var: _Variant | None,
        grid: tuple[int, int, int],
        key: Hashable,
        device_index: int,
        aligned: bool,
        fast_args: Callable[[], Sequence[object]],
        slow: Callable[[tuple[int, int, int]], object],
    ) -> None:
        """Launch on ``grid``.

        Parameters
        ----------
        var
            ``self.lookup(key, aligned)`` (looked up once by the caller, who may size the
            grid from ``var.capacity``).
        grid
            Programs along the three axes.
        key
            Pins the variant (see the module docstring); must include ``device_index``.
        device_index
            CUDA device of the tensors (``-1``: CPU, i.e. interpreted).
        aligned
            Every tensor pointer among the arguments is a multiple of 16.
        fast_args
            Builds the positional arguments of the kernel in order, tensors replaced by
            their ``data_ptr()`` and ``None`` left as is; constexpr positions may hold
            anything (the launcher ignores them).
        slow
            ``slow(grid)`` launches through ``kernel[grid](...)`` and returns what Triton
            returns (the compiled kernel on a GPU).
        """
        if var is not None and device_index == _current_device() and not _launch_hook_set():
            stream = torch._C._cuda_getCurrentRawStream(device_index)
            if var.c_launch is not None:
                var.c_launch(
                    grid[0], grid[1], grid[2], stream, var.function, var.coop, var.pdl, None,
                    None, var.meta, None, None, None, *fast_args(),
                )  # fmt: skip
            else:
                var.run(
                    grid[0], grid[1], grid[2], stream, var.function, var.meta, None, None, None,
                    *fast_args(),
                )  # fmt: skip
            return
        if device_index >= 0 and device_index != _current_device():
            with torch.cuda.device(device_index):
                compiled = slow(grid)
        else:
            compiled = slow(grid)
        if self._compiled and aligned and var is None and _usable(compiled):
            self._variants[key] = _Variant(compiled, device_index)


def _current_device() -> int:
    # torch.cuda.current_device() without its lazy-init checks: a direct launch only
    # happens after a normal one on this device, which initialised CUDA.
    return torch._C._cuda_getDevice()


def device_capacity(device_index: int, num_warps: int, n_regs: int, shared: int) -> int:
    """Programs of one variant that fit on the device at once (one full wave).

    Occupancy from the per-SM limits of registers, warps, blocks and shared memory; CPU
    (``device_index < 0``) counts as one program.
    """
    if device_index < 0:
        return 1
    props = _props(device_index)
    sms, max_threads, regs, smem = props
    warps_per_sm = max_threads // 32
    by_warps = warps_per_sm // max(num_warps, 1)
    # Registers are allocated per warp in units of 256 (8 per thread).
    regs_per_warp = ((max(n_regs, 1) * 32 + 255) // 256) * 256
    by_regs = regs // (regs_per_warp * max(num_warps, 1)) if n_regs > 0 else by_warps
    by_smem = smem // shared if shared > 0 else by_warps
    per_sm = max(1, min(32, by_warps, by_regs, by_smem))
    return sms * per_sm


_PROPS: dict[int, tuple[int, int, int, int]] = {}


def _props(device_index: int) -> tuple[int, int, int, int]:
    got = _PROPS.get(device_index)
    if got is None:
        p = torch.cuda.get_device_properties(device_index)
        got = (
            int(p.multi_processor_count),
            int(getattr(p, "max_threads_per_multi_processor", 2048)),
            int(getattr(p, "regs_per_multiprocessor", 65536)),
            int(getattr(p, "shared_memory_per_multiprocessor", 228 * 1024)),
        )
        _PROPS[device_index] = got
    return got
