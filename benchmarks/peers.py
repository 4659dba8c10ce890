"""The peers' Mamba2 decode SSM updates, callable at hybridmeta's calling convention.

The peers' code is never committed: ``scripts/fetch_peers.sh`` downloads the released
packages and keeps only their SSM-update kernels in a bundle (default ``third_party/peers``,
or the folder named by ``$HYBRIDMETA_PEERS``). This module puts the bundle on ``sys.path``
and wraps each peer so that it takes the arguments of
:func:`hybridmeta.kernels.ssm_state_update`. Every entry point returns ``None`` (and
:func:`why_unavailable` the reason) when a peer cannot run here: no bundle, an import that
fails (FlashInfer's runtime ``tvm_ffi`` is carried for CPython 3.12 only), or no CUDA.

Peers (versions as fetched; ``VERSIONS.json`` in the bundle has file names and sha256)
-----------------------------------------------------------------------------------
``flashinfer``  flashinfer-python 0.7.4, ``flashinfer.mamba.selective_state_update`` (CUDA
                C++, JIT-built with nvcc on first use, one module per dtype set, head dim,
                dstate and ``T``: 16 s for four modules built in parallel on the H200
                machine's 16 cores; see "FlashInfer build cache").
``vllm``        vllm 0.33.0, ``vllm/model_executor/layers/mamba/ops/mamba_ssm.py`` (Triton).
``sglang``      sglang 0.5.23, ``sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py`` (Triton).
``mamba_ssm``   mamba-ssm 2.3.2.post1 sdist, ``mamba_ssm/ops/triton/selective_state_update.py``
                (Triton; single-token only).

Uniform calling convention (what :func:`single_token` and :func:`multi_token` return)
-------------------------------------------------------------------------------------
Single token, as ``hybridmeta.kernels.ssm_state_update``::

    fn(state, x, dt, A, B, C, *, state_indices, D=None, z=None, dt_bias=None,
       dt_softplus=False, out=None) -> out

``state [slots, H, P, N]`` (fp32 or bf16, updated in place), ``x, z [bs, H, P]``,
``dt [bs, H]``, ``A, D, dt_bias [H]``, ``B, C [bs, G, N]``, ``state_indices [bs]`` int32 or
int64 with ``-1`` for a pad row (no state read or written). Returns ``out [bs, H, P]``.
A pad row's output differs: hybridmeta and mamba_ssm write zeros; FlashInfer, vLLM and
sglang write ``D * x * silu(z)``, the update of a zero state.

Multi token (speculative verify: ``T`` draft tokens per row, a chain)::

    fn(state, x, dt, A, B, C, *, state_indices, intermediate_states, D=None, z=None,
       dt_bias=None, dt_softplus=False, parent_token=None, out=None) -> out

``x, z [bs, T, H, P]``, ``dt [bs, T, H]``, ``B, C [bs, T, G, N]``; the row's state is read
from ``state[state_indices[b]]`` and NOT written; the state after token ``t`` goes to
``intermediate_states[b, t]`` (``[bs, T, H, P, N]``, contiguous, the state's dtype); pad rows
write no intermediate state. ``out [bs, T, H, P]``. ``parent_token [bs, T]`` (EAGLE trees:
token ``t`` starts from the state after token ``parent_token[b, t]``) only for sglang.
For vLLM, ``intermediate_states`` must live in the same allocation as ``state``, after
it, on a slot boundary (vLLM writes per-token states into slots of the pool it reads)::

    pool = torch.empty(slots + bs * T, H, P, N)        # one allocation serves every peer
    state, inter = pool[:slots], pool[slots:].view(bs, T, H, P, N)

What the adapters add per call: views that broadcast ``A``/``D``/``dt_bias``/``dt`` over
``P`` and ``N`` (no copy); zeros for a missing ``D``/``dt_bias`` (cached) where the peer needs
one; FlashInfer casts ``dt`` to ``D``'s dtype when they differ (one elementwise kernel over
``[bs, H]``, exact for bf16 -> fp32: pass an fp32 ``dt`` to avoid it); mamba_ssm allocates
its own output (``out`` given costs a copy); vLLM multi-token builds its per-token slot table
with two small kernels. Index helper tensors (``arange``, ones) are cached per shape: call
once before capturing a CUDA graph.

Each peer's own conventions (for porting their tests and the spec-decode work)
-----------------------------------------------------------------------------
All four take ``A [H, P, N]``, ``dt [bs, H, P]``, ``D, dt_bias [H, P]`` and detect the
Mamba2 "tied" case (one scalar per head) from strides: ``A`` stride ``(1, 0, 0)``, ``dt``
and ``dt_bias`` stride 0 on ``P``. ``B, C [bs, G, N]``, head ``h`` uses group
``h // (H // G)``. Pad rows: the state load is masked to zero and the write skipped.

* **FlashInfer** ``selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=None,
  dt_softplus=False, state_batch_indices=None, pad_slot_id=-1, out=None,
  disable_state_update=False, intermediate_states_buffer=None,
  intermediate_state_indices=None, cache_steps=0, dst_state_batch_indices=None,
  cu_seqlens=None, num_accepted_tokens=None, algorithm="auto", ...)``.
  Requires (C++ checks): ``D`` given; ``A``, ``D``, ``dt_bias`` stride exactly ``(1, 0[, 0])``
  and ``dt`` stride 0 on ``P`` (tied only); ``D``/``dt_bias`` in ``dt``'s dtype, ``B``/``C``/
  ``z``/``out`` in ``x``'s; state slots contiguous ``[H, P, N]``; ``state.size(0) >= bs``.
  Indices int32 or int64 (a JIT specialisation; all index tensors one dtype), ``pad_slot_id``
  any value (default -1); pad rows still get an output. Multi-token: 4-D ``x [bs, T, H, P]``
  with ``cache_steps >= 1`` (``T`` is a JIT specialisation), or varlen 3-D
  ``x [total, H, P]`` with ``cu_seqlens [N+1]`` and ``cache_steps = max_seqlen``.
  Intermediate states either (a) sglang-style into
  ``intermediate_states_buffer [*, cache_steps, H, P, N]`` at entry
  ``intermediate_state_indices[b]`` (or the state slot when absent), step ``t`` at
  ``[entry, t]``; or (b) vLLM-style into pool slots ``dst_state_batch_indices [N, T]``
  (``pad_slot_id`` skips; mutually exclusive with (a)). Accepted counts: vLLM-style
  ``num_accepted_tokens [N]`` with 2-D ``state_batch_indices [N, T]``: the initial state is
  read from ``state_batch_indices[b, max(num_accepted[b] - 1, 0)]``. No trees.
* **vLLM** ``selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None,
  dt_softplus=False, state_batch_indices=None, dst_state_batch_indices=None,
  null_block_id=NULL_BLOCK_ID, out=None, num_accepted_tokens=None, cu_seqlens=None,
  is_blackwell=False, ...)``: ``D``, ``dt_bias`` and ``out`` required (returns None).
  **Pad sentinel is ``null_block_id``, default ``NULL_BLOCK_ID = 0`` in 0.33.0, not -1**:
  the adapters pass ``null_block_id=-1``; called natively, slot 0 is the null block.
  Indices any int dtype (loaded and widened to int64); ``state_batch_indices`` and
  ``dst_state_batch_indices`` 1-D ``[bs]`` or 2-D ``[N, max_seqlen]``; a separate
  ``dst`` slot writes the new state elsewhere (default: in place). Multi-token only as
  varlen: ``x [total_tokens, H, P]``, ``cu_seqlens [N+1]``; with ``num_accepted_tokens [N]``
  (spec mode) the initial state comes from ``state_batch_indices[b, max(num_accepted - 1,
  0)]`` (so "commit" is just the next step reading the last accepted token's slot), the
  state after token ``t`` is stored to pool slot ``dst_state_batch_indices[b, t]``
  (``null_block_id`` skips) and no final state is written. Launch config from JSON files
  keyed by head dim, dstate, device name and cache dtype; none ships for head dim 80, so
  the default ``BLOCK_SIZE_M=4, num_warps=4`` runs on an H200 (a warning says so).
* **sglang** ``selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
  dt_softplus=False, state_batch_indices=None, pad_slot_id=-1, out=None,
  disable_state_update=False, intermediate_states_buffer=None, cache_steps=None,
  retrieve_parent_token=None, intermediate_state_indices=None, ...)``: ``out`` required;
  ``dt_bias`` and ``D`` must be given (``None`` crashes the launcher). Pad ``-1``; indices
  any int dtype (widened to int64). Multi-token: 4-D ``x [bs, T, H, P]`` (``dt``, ``B``,
  ``C``, ``z``, ``out`` likewise); the state after token ``t`` goes to
  ``intermediate_states_buffer`` viewed as contiguous ``[*, cache_steps, H, P, N]`` at entry
  ``intermediate_state_indices[b]`` (default: the row's state slot), pad rows skipped;
  ``disable_state_update=True`` in verify keeps the working slot. Accepted counts are not
  a kernel argument: after verify sglang scatters ``intermediate[entry, accepted - 1]``
  into the slot (``update_mamba_state_after_mtp_verify``). Trees: ``retrieve_parent_token
  [bs, T]``, step ``t > 0`` restarts from the cached state of its parent. Launches with
  PDL on sm90+.
* **mamba_ssm** ``selective_state_update(state, x, dt, A, B, C, D=None, z=None,
  dt_bias=None, dt_softplus=False, state_batch_indices=None) -> out`` (allocates ``out``);
  ``dt_bias`` and ``D`` must be given (``None`` crashes the launcher). Pad: any negative
  index, output set to 0. The index is not widened: int32 indices overflow the offset past
  2**31 elements (about 1,600 slots at Nano-9B shapes); pass int64. No multi-token.

FlashInfer build cache
----------------------
A JIT build lands in ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/0.7.4/<arch>/
cached_ops/<uri>/<uri>.so`` (this module defaults the base to a temporary folder). Such a
``.so`` is not reused from there on a fresh machine (ninja sees newer generated sources),
but FlashInfer loads any ``flashinfer/data/aot/<uri>/<uri>.so`` without building (seen
with ``FLASHINFER_DISABLE_JIT=1`` in a fresh workspace: import 0.5 s, no nvcc).
:func:`export_flashinfer_aot` (run by ``--out``) packs each built module as
``aot/<uri>/<uri>.so`` in ``$OUT/<uri>.tar.xz`` (0.5 MB; the ``.so`` is 2.4 MB). Put those
files into ``<bundle>/flashinfer_aot/`` and :func:`setup` unpacks them into
``<bundle>/py/flashinfer/data/`` before FlashInfer is imported. ``<uri>`` names the state,
input (``x``), weight (``dt`` after the cast: ``D``'s dtype), ``A`` and index dtypes, head
dim, dstate and ``T`` (``nt``); another combination JIT-builds on first use.

Run the GPU check (agreement with hybridmeta and a float64 reference, one timing each)::

    PYTHONPATH=src python3 benchmarks/peers.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import importlib
import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

import torch
from torch import Tensor

PEERS: tuple[str, ...] = ("flashinfer", "vllm", "sglang", "mamba_ssm")
ENV_VAR = "HYBRIDMETA_PEERS"
PAD = -1
_REPO = Path(__file__).resolve().parent.parent
_MODULES = {
    "flashinfer": "flashinfer.mamba",
    "vllm": "peer_vllm",
    "sglang": "peer_sglang",
    "mamba_ssm": "peer_mamba_ssm",
}
_MULTI = frozenset({"flashinfer", "vllm", "sglang"})


class SingleToken(Protocol):
    """A peer's single-token SSM update at hybridmeta's calling convention."""

    def __call__(
        self,
        state: Tensor,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        *,
        state_indices: Tensor,
        D: Tensor | None = None,
        z: Tensor | None = None,
        dt_bias: Tensor | None = None,
        dt_softplus: bool = False,
        out: Tensor | None = None,
    ) -> Tensor: ...


class MultiToken(Protocol):
    """A peer's multi-token (speculative verify) SSM update; see the module docstring."""

    def __call__(
        self,
        state: Tensor,
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        *,
        state_indices: Tensor,
        intermediate_states: Tensor,
        D: Tensor | None = None,
        z: Tensor | None = None,
        dt_bias: Tensor | None = None,
        dt_softplus: bool = False,
        parent_token: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class Peer:
    """One peer as loaded here: its entry points, or why it is unavailable."""

    name: str
    version: str | None
    single_token: SingleToken | None
    multi_token: MultiToken | None
    reason: str | None


def bundle_path() -> Path:
    """The bundle folder: ``$HYBRIDMETA_PEERS`` if set, else ``<repo>/third_party/peers``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).resolve() if env else _REPO / "third_party" / "peers"


def versions(path: Path | None = None) -> dict[str, Any]:
    """``VERSIONS.json`` of the bundle (package, version, file, sha256 per peer); ``{}``
    when there is none."""
    f = (path or bundle_path()) / "VERSIONS.json"
    if not f.is_file():
        return {}
    return cast(dict[str, Any], json.loads(f.read_text()))


def setup(path: Path | None = None) -> Path:
    """Put ``<bundle>/py`` on ``sys.path`` (ahead of any installed ``flashinfer`` or
    ``tvm_ffi``), unpack prebuilt FlashInfer modules from ``<bundle>/flashinfer_aot/*.tar.xz``
    and point FlashInfer's JIT workspace at a writable folder
    (``$FLASHINFER_WORKSPACE_BASE`` if set, else a temporary one).

    Raises
    ------
    FileNotFoundError
        If the bundle or its ``py`` folder is missing (names the path and the script).
    """
    root = path or bundle_path()
    py = root / "py"
    if not py.is_dir():
        raise FileNotFoundError(
            f"peers bundle not found: {py} is not a folder (run scripts/fetch_peers.sh, "
            f"or set {ENV_VAR} to the bundle)"
        )
    _install_flashinfer_aot(root)
    if str(py) not in sys.path:
        sys.path.insert(0, str(py))
    os.environ.setdefault(
        "FLASHINFER_WORKSPACE_BASE", str(Path(tempfile.gettempdir()) / "hybridmeta-flashinfer")
    )
    return root


def _install_flashinfer_aot(root: Path) -> list[str]:
    """Unpack ``<root>/flashinfer_aot/*.tar.xz`` (each ``aot/<uri>/<uri>.so``, as
    :func:`export_flashinfer_aot` writes them) into ``<root>/py/flashinfer/data/``."""
    data = root / "py" / "flashinfer" / "data"
    installed = []
    for archive in sorted((root / "flashinfer_aot").glob("*.tar.xz")):
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                parts = Path(m.name).parts
                if not (m.isfile() or m.isdir()) or parts[:1] != ("aot",) or ".." in parts:
                    raise ValueError(
                        f"{archive}: member {m.name!r} is not a file under aot/ (expected "
                        "aot/<uri>/<uri>.so, as export_flashinfer_aot writes)"
                    )
            if not all((data / m.name).exists() for m in members if m.isfile()):
                tar.extractall(data, members=members, filter="data")
            installed += [Path(m.name).stem for m in members if m.isfile()]
    return installed


@functools.cache
def _load(name: str, path: Path) -> tuple[ModuleType | None, str | None]:
    try:
        setup(path)
    except (OSError, ValueError, tarfile.TarError) as e:  # no bundle, or a bad archive in it
        return None, str(e)
    try:
        module = importlib.import_module(_MODULES[name])
    except Exception as e:  # a peer is optional: report why it cannot run
        return None, f"{name}: import of {_MODULES[name]} failed: {e!r}"
    if not torch.cuda.is_available():
        return module, f"{name}: imported, but its kernels need a CUDA device"
    return module, None


def _check_name(name: str) -> None:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; the peers are {', '.join(PEERS)}")


def why_unavailable(name: str) -> str | None:
    """Why peer ``name`` cannot run here, or ``None`` when it can."""
    _check_name(name)
    return _load(name, bundle_path())[1]


def peer(name: str) -> Peer:
    """Peer ``name`` with its entry points (``None`` where unavailable)."""
    _check_name(name)
    module, reason = _load(name, bundle_path())
    version = versions().get(name, {}).get("version")
    if module is None or reason is not None:
        return Peer(name, version, None, None, reason)
    fn = cast(Callable[..., Any], module.selective_state_update)
    single, multi = _ADAPTERS[name](fn)
    return Peer(name, version, single, multi, None)


def single_token(name: str) -> SingleToken | None:
    """Peer ``name``'s single-token update, or ``None`` (see :func:`why_unavailable`)."""
    return peer(name).single_token


def multi_token(name: str) -> MultiToken | None:
    """Peer ``name``'s multi-token update, or ``None`` where it has none or cannot run."""
    return peer(name).multi_token


# ---------------------------------------------------------------- argument helpers


@functools.lru_cache(maxsize=64)
def _arange(n: int, dtype: torch.dtype, device: torch.device, offset: int = 0) -> Tensor:
    return torch.arange(offset, offset + n, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def _filled(n: int, value: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((n,), value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def _cu_seqlens(n: int, t: int, device: torch.device) -> Tensor:
    return torch.arange(0, n * t + 1, t, dtype=torch.int32, device=device)


def _per_head(v: Tensor | None, state: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``[H]`` -> ``[H, P]`` broadcast view (stride ``(1, 0)``); zeros when ``v`` is None."""
    heads, p = state.shape[1], state.shape[2]
    if v is None:
        return _filled(heads, 0, dtype or torch.float32, state.device)[:, None].expand(heads, p)
    v = v.contiguous()
    if dtype is not None and v.dtype != dtype:
        v = v.to(dtype)
    return v[:, None].expand(heads, p)


def _tied_A(A: Tensor, state: Tensor) -> Tensor:
    heads, p, n = state.shape[1:]
    return A.contiguous()[:, None, None].expand(heads, p, n)


def _check_single(state: Tensor, x: Tensor, dt: Tensor) -> None:
    if state.dim() != 4:
        raise ValueError(f"`state` must be [slots, H, P, N], got shape {tuple(state.shape)}")
    if x.dim() != 3 or dt.dim() != 2:
        raise ValueError(
            f"single token: `x` must be [bs, H, P] and `dt` [bs, H], got {tuple(x.shape)} "
            f"and {tuple(dt.shape)}"
        )


def _check_multi(state: Tensor, x: Tensor, dt: Tensor, inter: Tensor) -> None:
    if state.dim() != 4:
        raise ValueError(f"`state` must be [slots, H, P, N], got shape {tuple(state.shape)}")
    if x.dim() != 4 or dt.dim() != 3:
        raise ValueError(
            f"multi token: `x` must be [bs, T, H, P] and `dt` [bs, T, H], got "
            f"{tuple(x.shape)} and {tuple(dt.shape)}"
        )
    want = (*x.shape[:2], *state.shape[1:])
    if tuple(inter.shape) != want or inter.dtype != state.dtype or not inter.is_contiguous():
        raise ValueError(
            f"`intermediate_states` must be contiguous {list(want)} in {state.dtype}, got "
            f"{tuple(inter.shape)} {inter.dtype} contiguous={inter.is_contiguous()}"
        )


def _no_tree(name: str, parent_token: Tensor | None) -> None:
    if parent_token is not None:
        raise ValueError(f"{name}: `parent_token` (trees) is not supported by this peer")


# ---------------------------------------------------------------- adapters

_Pair = tuple[SingleToken | None, MultiToken | None]


def _flashinfer(fn: Callable[..., Any]) -> _Pair:
    def weights(
        state: Tensor, dt: Tensor, D: Tensor | None, dt_bias: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        # FlashInfer wants D and dt_bias in dt's dtype: bring dt to D's (exact for bf16).
        wd = D.dtype if D is not None else dt_bias.dtype if dt_bias is not None else dt.dtype
        dt = dt if dt.dtype == wd else dt.to(wd)
        bias = None if dt_bias is None else _per_head(dt_bias, state, wd)
        return dt, _per_head(D, state, wd), bias

    def single(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, D: Tensor | None = None, z: Tensor | None = None,
        dt_bias: Tensor | None = None, dt_softplus: bool = False, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_single(state, x, dt)
        dtw, d2, bias = weights(state, dt, D, dt_bias)
        out = torch.empty_like(x) if out is None else out
        fn(
            state, x, dtw[:, :, None].expand(*x.shape), _tied_A(A, state), B, C, d2, z=z,
            dt_bias=bias, dt_softplus=dt_softplus, state_batch_indices=state_indices,
            pad_slot_id=PAD, out=out,
        )  # fmt: skip
        return out

    def multi(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, intermediate_states: Tensor, D: Tensor | None = None,
        z: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
        parent_token: Tensor | None = None, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_multi(state, x, dt, intermediate_states)
        _no_tree("flashinfer", parent_token)
        bs, t = x.shape[:2]
        dtw, d2, bias = weights(state, dt, D, dt_bias)
        out = torch.empty_like(x) if out is None else out
        fn(
            state, x, dtw[..., None].expand(*x.shape), _tied_A(A, state), B, C, d2, z=z,
            dt_bias=bias, dt_softplus=dt_softplus, state_batch_indices=state_indices,
            pad_slot_id=PAD, out=out, disable_state_update=True,
            intermediate_states_buffer=intermediate_states,
            intermediate_state_indices=_arange(bs, state_indices.dtype, state.device),
            cache_steps=t,
        )  # fmt: skip
        return out

    return single, multi


def _vllm(fn: Callable[..., Any]) -> _Pair:
    def single(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, D: Tensor | None = None, z: Tensor | None = None,
        dt_bias: Tensor | None = None, dt_softplus: bool = False, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_single(state, x, dt)
        out = torch.empty_like(x) if out is None else out
        fn(
            state, x, dt[:, :, None].expand(*x.shape), _tied_A(A, state), B, C,
            _per_head(D, state), _per_head(dt_bias, state), z=z, dt_softplus=dt_softplus,
            state_batch_indices=state_indices, null_block_id=PAD, out=out,
        )  # fmt: skip
        return out

    def multi(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, intermediate_states: Tensor, D: Tensor | None = None,
        z: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
        parent_token: Tensor | None = None, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_multi(state, x, dt, intermediate_states)
        _no_tree("vllm", parent_token)
        first = _pool_slot(state, intermediate_states)
        bs, t, heads, p = x.shape
        g, n = B.shape[2:]
        out = torch.empty_like(x) if out is None else out
        # Token t of row b stores its state to pool slot first + b*T + t (pad rows: none).
        slots = _arange(bs * t, state_indices.dtype, state.device, first).view(bs, t)
        dst = torch.where(state_indices[:, None] < 0, PAD, slots)
        flat_dt = dt.reshape(bs * t, heads)
        fn(
            state, x.reshape(bs * t, heads, p), flat_dt[:, :, None].expand(bs * t, heads, p),
            _tied_A(A, state), B.reshape(bs * t, g, n), C.reshape(bs * t, g, n),
            _per_head(D, state), _per_head(dt_bias, state),
            z=None if z is None else z.reshape(bs * t, heads, p), dt_softplus=dt_softplus,
            state_batch_indices=state_indices[:, None], dst_state_batch_indices=dst,
            null_block_id=PAD, out=out.view(bs * t, heads, p),
            num_accepted_tokens=_filled(bs, 1, torch.int32, state.device),
            cu_seqlens=_cu_seqlens(bs, t, state.device),
        )  # fmt: skip
        return out

    return single, multi


def _pool_slot(state: Tensor, inter: Tensor) -> int:
    """Slot index of ``inter[0, 0]`` in ``state``'s pool (vLLM writes there)."""
    es = state.element_size()
    slot_elems = state[0].numel()
    same = inter.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
    offset = inter.data_ptr() - state.data_ptr()
    if (
        not same
        or state.stride(0) != slot_elems
        or not state[0].is_contiguous()
        or offset < 0
        or offset % (slot_elems * es) != 0
    ):
        raise ValueError(
            "vllm: `intermediate_states` must be a contiguous view of the same allocation as "
            "`state`, after it and on a slot boundary (vLLM stores per-token states into "
            "slots of the pool it reads), e.g. pool = torch.empty(slots + bs * T, H, P, N); "
            "state, inter = pool[:slots], pool[slots:].view(bs, T, H, P, N)"
        )
    return offset // (slot_elems * es)


def _sglang(fn: Callable[..., Any]) -> _Pair:
    def single(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, D: Tensor | None = None, z: Tensor | None = None,
        dt_bias: Tensor | None = None, dt_softplus: bool = False, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_single(state, x, dt)
        out = torch.empty_like(x) if out is None else out
        fn(
            state, x, dt[:, :, None].expand(*x.shape), _tied_A(A, state), B, C,
            D=_per_head(D, state), z=z, dt_bias=_per_head(dt_bias, state),
            dt_softplus=dt_softplus, state_batch_indices=state_indices, pad_slot_id=PAD,
            out=out,
        )  # fmt: skip
        return out

    def multi(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, intermediate_states: Tensor, D: Tensor | None = None,
        z: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
        parent_token: Tensor | None = None, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_multi(state, x, dt, intermediate_states)
        bs, t = x.shape[:2]
        out = torch.empty_like(x) if out is None else out
        fn(
            state, x, dt[..., None].expand(*x.shape), _tied_A(A, state), B, C,
            D=_per_head(D, state), z=z, dt_bias=_per_head(dt_bias, state),
            dt_softplus=dt_softplus, state_batch_indices=state_indices, pad_slot_id=PAD,
            out=out, disable_state_update=True, intermediate_states_buffer=intermediate_states,
            cache_steps=t, retrieve_parent_token=parent_token,
            intermediate_state_indices=_arange(bs, state_indices.dtype, state.device),
        )  # fmt: skip
        return out

    return single, multi


def _mamba_ssm(fn: Callable[..., Any]) -> _Pair:
    def single(
        state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
        state_indices: Tensor, D: Tensor | None = None, z: Tensor | None = None,
        dt_bias: Tensor | None = None, dt_softplus: bool = False, out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        _check_single(state, x, dt)
        res = cast(
            Tensor,
            fn(
                state, x, dt[:, :, None].expand(*x.shape), _tied_A(A, state), B, C,
                _per_head(D, state), z, _per_head(dt_bias, state), dt_softplus, state_indices,
            ),
        )  # fmt: skip
        if out is None:
            return res
        return out.copy_(res)

    return single, None


_ADAPTERS: dict[str, Callable[[Callable[..., Any]], _Pair]] = {
    "flashinfer": _flashinfer,
    "vllm": _vllm,
    "sglang": _sglang,
    "mamba_ssm": _mamba_ssm,
}


# ---------------------------------------------------------------- FlashInfer build cache


def prebuild_flashinfer(
    state_dtypes: tuple[torch.dtype, ...],
    tokens: tuple[int, ...],
    *,
    dim: int,
    dstate: int,
    input_dtype: torch.dtype = torch.bfloat16,
    weight_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
) -> list[str]:
    """JIT-build FlashInfer's modules for every state dtype and token count ``T`` (1 =
    single token) in parallel; returns their names. The dtypes must match the calls that
    follow (``weight_dtype`` = ``D``'s dtype, ``dt`` is cast to it; ``A`` is float32)."""
    setup()
    ssu = importlib.import_module("flashinfer.mamba.selective_state_update")
    device = torch.device("cuda", torch.cuda.current_device())

    def build(sd: torch.dtype, t: int) -> str:
        ssu.get_selective_state_update_module(
            device, sd, input_dtype, weight_dtype, torch.float32, index_dtype, dim, dstate, t,
            torch.int32, torch.int64,
        )  # fmt: skip
        return f"{str(sd).removeprefix('torch.')} T={t}"

    jobs = [(sd, t) for sd in state_dtypes for t in tokens]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: build(*job), jobs))


def flashinfer_built() -> list[Path]:
    """The FlashInfer modules JIT-built in this workspace (``.so`` files)."""
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", str(Path.home())))
    return sorted((base / ".cache" / "flashinfer").glob("*/*/cached_ops/*/*.so"))


def export_flashinfer_aot(dest: Path) -> list[Path]:
    """Pack each built module as ``aot/<uri>/<uri>.so`` into ``dest/<uri>.tar.xz``;
    unpacked into ``<bundle>/py/flashinfer/data/`` they load without a build."""
    written = []
    for so in flashinfer_built():
        path = dest / f"{so.stem}.tar.xz"
        with tarfile.open(path, "w:xz") as tar:
            tar.add(so, arcname=f"aot/{so.stem}/{so.name}")
        written.append(path)
    return written


# ---------------------------------------------------------------- GPU check


def reference(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, idx: Tensor,
    D: Tensor, z: Tensor, dt_bias: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """float64 chain over ``T`` tokens (``x [bs, T, H, P]``) with softplus; pad rows start
    from zeros. Returns ``out [bs, T, H, P]`` and the states ``[bs, T, H, P, N]``."""
    _, t, heads, _ = x.shape
    rep = heads // B.shape[2]
    s = state[idx.clamp(min=0)].double() * (idx >= 0).double()[:, None, None, None]
    outs, states = [], []
    for k in range(t):
        d = torch.nn.functional.softplus(dt[:, k].double() + dt_bias.double())  # [bs, H]
        b = B[:, k].double().repeat_interleave(rep, 1)  # [bs, H, N]
        c = C[:, k].double().repeat_interleave(rep, 1)
        xk = x[:, k].double()
        s = s * torch.exp(A.double() * d)[:, :, None, None] + (d[:, :, None] * xk)[..., None] * b[
            :, :, None, :
        ]
        o = (s * c[:, :, None, :]).sum(-1) + D.double()[:, None] * xk
        zk = z[:, k].double()
        outs.append(o * zk * torch.sigmoid(zk))
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


class _Problem:
    H, P, N, G = 128, 80, 128, 8  # Nemotron-Nano-9B-v2 Mamba layer

    def __init__(
        self, bs: int, t: int, state_dtype: torch.dtype, seed: int, *, pad: bool = True
    ) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        H, P, N, G = self.H, self.P, self.N, self.G
        dev, act = torch.device("cuda"), torch.bfloat16
        self.bs, self.t = bs, t
        self.slots = 2 * bs + 3
        # One allocation: the state pool, then bs*T slots for the intermediate states.
        self.pool = torch.randn(self.slots + bs * t, H, P, N, device=dev, generator=g)
        self.pool = self.pool.to(state_dtype)
        self.state = self.pool[: self.slots]
        self.inter = self.pool[self.slots :].view(bs, t, H, P, N)
        self.inter.zero_()
        self.idx = torch.randperm(self.slots, device=dev, generator=g)[:bs].clone()
        if pad and bs > 2:
            self.idx[1] = PAD  # one pad row
        shape = (bs, t) if t > 1 else (bs,)
        self.x = torch.randn(*shape, H, P, device=dev, generator=g).to(act)
        self.z = torch.randn(*shape, H, P, device=dev, generator=g).to(act)
        self.dt = (torch.randn(*shape, H, device=dev, generator=g) * 0.5).to(act)
        self.B = torch.randn(*shape, G, N, device=dev, generator=g).to(act)
        self.C = torch.randn(*shape, G, N, device=dev, generator=g).to(act)
        self.A = -torch.rand(H, device=dev, generator=g)
        self.D = torch.randn(H, device=dev, generator=g)
        self.dt_bias = torch.randn(H, device=dev, generator=g) * 0.5
        self.state0 = self.state.clone()

    def reset(self) -> None:
        self.state.copy_(self.state0)
        self.inter.zero_()

    def kwargs(self) -> dict[str, Any]:
        return {"state_indices": self.idx, "D": self.D, "z": self.z, "dt_bias": self.dt_bias,
                "dt_softplus": True}  # fmt: skip

    def ref(self) -> tuple[Tensor, Tensor]:
        one = self.t == 1 and self.x.dim() == 3

        def u(v: Tensor) -> Tensor:  # a single-token problem is a chain of one
            return v[:, None] if one else v

        out, states = reference(self.state0, u(self.x), u(self.dt), self.A, u(self.B), u(self.C),
                                self.idx, self.D, u(self.z), self.dt_bias)  # fmt: skip
        return (out[:, 0], states[:, 0]) if one else (out, states)

    def errors(self, out: Tensor, multi: bool) -> dict[str, float]:
        ref_out, ref_states = self.ref()
        live = self.idx >= 0
        res = {"out_rel": _rel(out[live], ref_out[live])}
        if (~live).any():  # the pad row's output: zeros, or D*x*silu(z) of a zero state
            res["pad_out_is_zero"] = float(not out[~live].any())
            res["pad_out_rel_zero_state"] = _rel(out[~live], ref_out[~live])
        untouched = torch.ones(self.slots, dtype=torch.bool, device=self.idx.device)
        if multi:
            res["state_rel"] = _rel(self.inter[live], ref_states[live])
            res["pad_intermediate_written"] = float(self.inter[~live].abs().sum())
        else:
            res["state_rel"] = _rel(self.state[self.idx[live]], ref_states[live])
            untouched[self.idx[live]] = False
        res["other_slots_changed"] = float((self.state[untouched] != self.state0[untouched]).sum())
        return res


def main() -> None:  # pragma: no cover - GPU only
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bs", type=int, default=4, help="batch size of the agreement check")
    ap.add_argument("--time-bs", type=int, default=64, help="batch size of the timing")
    ap.add_argument("--tokens", type=int, default=4, help="T of the multi-token check")
    ap.add_argument("--build-timeout", type=float, default=240.0,
                    help="seconds to wait for FlashInfer's JIT builds")  # fmt: skip
    ap.add_argument("--only", nargs="*", default=None, help="peers to check (default: all)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from hybridmeta.kernels import ssm_state_update

    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "bundle": str(bundle_path()), "versions": {k: v.get("version") for k, v in versions().items()},
        "shapes": {"H": _Problem.H, "P": _Problem.P, "N": _Problem.N, "G": _Problem.G},
        "check": [], "timing": [], "flashinfer_build": {},
    }  # fmt: skip

    def save() -> None:
        (args.out / "peers.json").write_text(json.dumps(res, indent=1))

    import triton

    res["triton"] = triton.__version__
    dtypes = (torch.float32, torch.bfloat16)
    t0 = time.perf_counter()
    fi_reason = why_unavailable("flashinfer")
    fi_build: concurrent.futures.Future[list[str]] | None = None
    if fi_reason is None:  # build while the Triton peers compile and run
        fi_build = concurrent.futures.ThreadPoolExecutor(1).submit(
            prebuild_flashinfer, dtypes, (1, args.tokens), dim=_Problem.P, dstate=_Problem.N
        )
    res["flashinfer_build"]["import_s"] = round(time.perf_counter() - t0, 2)

    def ours(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             **kw: Any) -> Tensor:  # fmt: skip
        return ssm_state_update(state, x, dt, A, B, C, **kw)

    order = ["mamba_ssm", "sglang", "vllm", "flashinfer"]
    for name in ["hybridmeta", *order]:
        if args.only is not None and name not in args.only:
            continue
        if name == "flashinfer" and fi_build is not None:
            try:
                left = max(1.0, args.build_timeout - (time.perf_counter() - t0))
                res["flashinfer_build"]["modules"] = fi_build.result(timeout=left)
            except Exception as e:  # a failed or unfinished build: report, skip the peer
                res["flashinfer_build"]["error"] = repr(e)[-3000:]
            res["flashinfer_build"]["wall_s"] = round(time.perf_counter() - t0, 1)
            save()
            if "error" in res["flashinfer_build"]:
                continue
        p = None if name == "hybridmeta" else peer(name)
        fns: list[tuple[str, Callable[..., Tensor] | None]] = [
            ("single", ours if p is None else p.single_token),
            ("multi", None if p is None else p.multi_token),
        ]
        for kind, fn in fns:
            for sd in dtypes:
                row: dict[str, Any] = {"peer": name, "kind": kind,
                                       "state_dtype": str(sd).removeprefix("torch.")}  # fmt: skip
                if fn is None:
                    row["skipped"] = (p.reason if p is not None and p.reason else
                                      "no multi-token entry point")  # fmt: skip
                    res["check"].append(row)
                    continue
                multi = kind == "multi"
                t = args.tokens if multi else 1
                try:
                    prob = _Problem(args.bs, t, sd, seed=1)
                    extra = {"intermediate_states": prob.inter} if multi else {}
                    t1 = time.perf_counter()
                    out = fn(prob.state, prob.x, prob.dt, prob.A, prob.B, prob.C,
                             **prob.kwargs(), **extra)  # fmt: skip
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.perf_counter() - t1, 2)
                    row.update(prob.errors(out, multi))
                    if not multi and name != "hybridmeta":  # against our kernel too
                        ref_state = prob.state.clone()
                        prob.reset()
                        ours_out = ours(prob.state, prob.x, prob.dt, prob.A, prob.B, prob.C,
                                        **prob.kwargs())  # fmt: skip
                        live = prob.idx >= 0
                        row["vs_hybridmeta_out_rel"] = _rel(out[live], ours_out[live])
                        row["vs_hybridmeta_state_rel"] = _rel(ref_state, prob.state)
                    tprob = _Problem(args.time_bs, t, sd, seed=2, pad=False)
                    tprob.dt = tprob.dt.float()  # FlashInfer would cast a bf16 dt per call
                    textra = {"intermediate_states": tprob.inter} if multi else {}
                    tout = torch.empty_like(tprob.x)
                    us = do_bench(lambda: fn(tprob.state, tprob.x, tprob.dt, tprob.A, tprob.B,  # noqa: B023
                                             tprob.C, **tprob.kwargs(), **textra, out=tout),  # noqa: B023
                                  warmup=10, rep=50, return_mode="median") * 1000.0  # fmt: skip
                    es = tprob.state.element_size()
                    per_row = _Problem.H * _Problem.P * _Problem.N * es
                    nbytes = args.time_bs * per_row * (1 + t)  # state read + T state writes
                    res["timing"].append({"peer": name, "kind": kind, "state_dtype": row["state_dtype"],
                                          "bs": args.time_bs, "T": t, "us": round(us, 2),
                                          "state_tbps": round(nbytes / us / 1e6, 3)})  # fmt: skip
                except Exception as e:
                    row["error"] = repr(e)[-2000:]
                res["check"].append(row)
                print(json.dumps(row), flush=True)
                save()
    for r in res["timing"]:
        print(json.dumps(r), flush=True)
    if flashinfer_built():
        res["flashinfer_build"]["built"] = [str(s) for s in flashinfer_built()]
        aot = export_flashinfer_aot(args.out)
        res["flashinfer_build"]["aot"] = {a.name: a.stat().st_size for a in aot}
        res["flashinfer_build"]["so_bytes"] = {s.stem: s.stat().st_size for s in flashinfer_built()}
    save()
    if fi_build is not None and not fi_build.done():
        os._exit(0)  # do not wait for an unfinished nvcc build at exit


def aot_smoke(out: Path) -> None:  # pragma: no cover - GPU only
    """One FlashInfer call per prebuilt module in a fresh process: run with
    ``FLASHINFER_DISABLE_JIT=1`` to prove the ``data/aot`` modules load without nvcc."""
    t0 = time.perf_counter()
    fi = peer("flashinfer")
    res: dict[str, Any] = {"reason": fi.reason, "import_s": round(time.perf_counter() - t0, 2)}
    rows = []
    for sd in (torch.float32, torch.bfloat16):
        for t in (1, 4):
            fn: Callable[..., Tensor] | None = fi.single_token if t == 1 else fi.multi_token
            if fn is None:
                continue
            prob = _Problem(4, t, sd, seed=1)
            extra = {"intermediate_states": prob.inter} if t > 1 else {}
            t1 = time.perf_counter()
            try:
                o = fn(prob.state, prob.x, prob.dt, prob.A, prob.B, prob.C, **prob.kwargs(),
                       **extra)  # fmt: skip
                torch.cuda.synchronize()
                rows.append({"state_dtype": str(sd), "T": t, "s": round(time.perf_counter() - t1, 2),
                             **prob.errors(o, t > 1)})  # fmt: skip
            except Exception as e:
                rows.append({"state_dtype": str(sd), "T": t, "error": repr(e)[-1500:]})
    res["calls"] = rows
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--aot-smoke":
        aot_smoke(Path(sys.argv[2]))
        sys.exit(0)
    main()
