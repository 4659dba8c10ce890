"""The reference hybrid runtime: a step loop over mixed prefill/decode batches.

Each :meth:`Runtime.step`

1. admits waiting requests while working slots are free (a request that finds none
   waits in the queue; live state is never overwritten). An admitted request whose
   prompt starts with a cached prefix copies the track slot (conv + SSM state and the
   attention KV) into its working slot and prefills only the rest;
2. forms the step's prefill rows and decode rows and reserves a track slot for each row
   that reaches a track boundary (its last one this step). Each forward's metadata comes
   from the planner (:func:`hybridmeta.planner.plan_host`, the same declared constructors
   any engine uses), staged with the attention plan and the token ids in one
   host-to-device copy; the planner decides which boundary is saved how (one track policy
   for every implementation). Prefill rows run :meth:`NemotronH.forward_prefill`; decode
   rows run the captured step of their bucket (:class:`DecodeGraphs`: ``GraphRunner``
   over ``StaticBuffers``), or eagerly, for the comparison;
3. copies the attention KV rows of the saved boundaries, samples (greedy, or
   teacher-forced tokens) and publishes the step's cache entries.

With speculative decoding (``RuntimeOptions.spec_tokens > 0``) a decode row drafts up to
``spec_tokens`` tokens from its own history (prompt lookup, :mod:`hybridmeta.runtime.spec`)
and the decode step becomes a verify step: one forward of the pending token and the
drafts of every row (captured per bucket ``(B, T)``, :class:`VerifyGraphs`), greedy
acceptance on the device, and the commit, which writes the working slot (the state after
the last accepted token) and, for a row whose accepted tokens cross a track boundary, the
track slot (the state after exactly the boundary token). Greedy outputs are the tokens
plain decoding would produce; a step just yields up to ``spec_tokens + 1`` of them per row.

All plans are computed from host-side data (lengths, slots, token lists) of the step's own
inputs. The only device-to-host transfer is the step's sampled tokens, once per step.

Decode steps overlap (``RuntimeOptions.overlap_decode``): a decode-only step after which
every row keeps decoding samples on the device and starts the copy of its tokens; the next
step, when it decodes the same rows and saves no track, takes those tokens as its input
ids on the device, plans, stages and launches its forward, and only then waits for them.
The host's work for a step thus runs while the previous step's forward runs on the GPU.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta import kernels
from hybridmeta.model import prepare_commit, prepare_target_verify
from hybridmeta.planner import BOOL_PARTS, MixedHostPlan, plan_host
from hybridmeta.runtime.decode_graphs import DecodeGraphs, VerifyGraphs
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.plan import attention_host_plan
from hybridmeta.runtime.prefix_cache import PrefixCache
from hybridmeta.runtime.spec import Accepted, greedy_accept, ngram_draft, plan_spec_step
from hybridmeta.runtime.state import SlotAllocator, StatePool
from hybridmeta.staging import to_device_packed

__all__ = ["Finished", "Request", "Runtime", "RuntimeOptions", "StepStats", "cold_logits"]


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    """Sizes and switches of a :class:`Runtime`.

    Attributes
    ----------
    num_working : int
        Working slots: requests that run at once.
    num_track : int
        Track slots: prefix-cache entries kept.
    max_len : int
        Longest sequence (prompt + generated tokens) a slot holds.
    track_interval : int
        Track boundary spacing; a multiple of the model's SSM chunk size.
    max_prefill_tokens : int
        Prefill token budget per step (>= ``track_interval``); longer prompts are split
        at multiples of the track interval.
    use_graphs : bool
        Decode through captured graphs (CUDA graphs on a GPU, emulation on the CPU).
    max_decode_bs : int or None
        Largest decode bucket (default ``num_working``).
    use_prefix_cache : bool
        Look up and save track boundaries (off: every request is a cold recompute).
    sync_timing : bool
        Synchronise the device around decode so ``decode_seconds`` is exact (benchmarks
        only; it adds two host syncs per step and turns ``overlap_decode`` off).
    spec_tokens : int
        Speculative decoding: draft up to this many tokens per decode row and step from
        the row's own history (n-gram prompt lookup) and verify them in one forward of up
        to ``spec_tokens + 1`` tokens per row; 0 (default) decodes one token per step.
        At most ``track_interval - 1`` (a verify then crosses at most one boundary).
    spec_ngram : int
        Longest suffix (in tokens) the drafter looks up; shorter ones are tried after it.
    overlap_decode : bool
        Overlap each decode step's host work with the previous step's forward (default).
        A decode-only step after which every row keeps decoding leaves its sampled tokens
        on the device; the next step, when it decodes the same rows and saves no track,
        feeds them to its forward from there, launches it, and only then waits for them
        (one device-to-host copy, as before). Tokens, log-probabilities and the prefix
        cache are those of the synchronous loop; between two such steps a request's
        ``tokens`` lack the last one (finished requests are always complete). Ignored
        with ``sync_timing`` and with speculative decoding.

    Which implementation the Mamba2 ops run (Triton or their references) is the op calls'
    business (:func:`hybridmeta.kernels.implementation`), not the runtime's.
    """

    num_working: int = 4
    num_track: int = 16
    max_len: int = 256
    track_interval: int = 16
    max_prefill_tokens: int = 256
    use_graphs: bool = True
    max_decode_bs: int | None = None
    use_prefix_cache: bool = True
    sync_timing: bool = False
    spec_tokens: int = 0
    spec_ngram: int = 3
    overlap_decode: bool = True

    def __attrs_post_init__(self) -> None:
        # Every combination that cannot run is refused here, before a Runtime allocates a
        # pool, captures a graph or writes any state (the model-dependent rule, the track
        # interval against the model's chunk size, is Runtime's).
        for name in ("use_graphs", "use_prefix_cache", "sync_timing", "overlap_decode"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"RuntimeOptions.{name} must be a bool, got {type(value).__name__} {value!r}"
                )
        for name, low in (
            ("num_working", 1),
            ("num_track", 1),
            ("max_len", 2),
            ("track_interval", 1),
            ("max_prefill_tokens", 1),
            ("spec_tokens", None),
            ("spec_ngram", 1),
            ("max_decode_bs", 1),
        ):
            value = getattr(self, name)
            if value is None and name == "max_decode_bs":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"RuntimeOptions.{name} must be an int, got {type(value).__name__} {value!r}"
                )
            if low is not None and value < low:
                why = {
                    "num_working": "(no request could ever be admitted)",
                    "max_len": "(a request holds at least one prompt and one new token)",
                }.get(name, "")
                raise ValueError(
                    f"RuntimeOptions.{name} must be >= {low}, got {value} {why}".rstrip()
                )
        if self.max_prefill_tokens < self.track_interval:
            raise ValueError(
                f"RuntimeOptions.max_prefill_tokens must be >= track_interval "
                f"{self.track_interval}, got {self.max_prefill_tokens}"
            )
        if not 0 <= self.spec_tokens < self.track_interval:
            raise ValueError(
                f"RuntimeOptions.spec_tokens must lie in [0, track_interval - 1 = "
                f"{self.track_interval - 1}] (a verify may cross at most one track boundary), "
                f"got {self.spec_tokens}"
            )
        if (
            self.use_graphs
            and self.max_decode_bs is not None
            and self.max_decode_bs < self.num_working
        ):
            raise ValueError(
                f"RuntimeOptions.max_decode_bs={self.max_decode_bs} is below num_working="
                f"{self.num_working}: a decode step runs up to num_working rows and the "
                "largest captured bucket must hold them all (leave max_decode_bs at None for "
                "num_working, or set use_graphs=False)"
            )


@attrs.define(eq=False)
class Request:
    """A request's host-side bookkeeping."""

    rid: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    forced: tuple[int, ...] | None
    tokens: list[int]
    num_computed: int = 0
    slot: int | None = None
    cached_tokens: int = 0
    logprobs: list[torch.Tensor] = attrs.Factory(list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


@attrs.frozen(kw_only=True, eq=False)
class Finished:
    """A finished request.

    Attributes
    ----------
    logprobs : torch.Tensor
        ``[max_new_tokens, V]`` fp32 log-probabilities each output token was drawn from.
    cached_tokens : int
        Prompt tokens served from the prefix cache.
    """

    rid: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    logprobs: torch.Tensor
    cached_tokens: int

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.output


@attrs.frozen(kw_only=True)
class StepStats:
    prefill_rows: int
    prefill_tokens: int
    decode_rows: int
    tracks_saved: int
    seconds: float


@attrs.frozen(kw_only=True, eq=False)
class _Drafts:
    """A verify step's rows, planned on the host (:meth:`Runtime._draft`)."""

    num_tokens: int  # T: the pending token and the longest draft
    slots: list[int]
    seq_lens: list[int]
    # [bs][T] pending token and draft (padded with the last); [bs][T] forced or -1
    rows: list[list[int]]
    targets: list[list[int]]
    draft_lens: list[int]
    # row -> (cache key, reserved track slot, boundary)
    tracked: dict[int, tuple[tuple[int, ...], int, int]]


@attrs.frozen(kw_only=True, eq=False)
class _Verified:
    """A verify step's device verdict and the host bookkeeping to apply it."""

    reqs: list[Request]
    accepted: Accepted
    draft_lens: list[int]
    seq_lens: list[int]
    # row -> (cache key, reserved track slot, boundary)
    tracked: dict[int, tuple[tuple[int, ...], int, int]]


@attrs.frozen(kw_only=True, eq=False)
class _PendingTokens:
    """A decode step's sampled tokens, still on the device (see ``overlap_decode``).

    ``choice`` (``[R]`` int64 on the device: the argmax, or the forced token) is the next
    step's ``input_ids``; ``host`` is its copy in page-locked memory, valid once ``ready``
    has completed (``None``: already valid, a CPU device). ``errors``: the kernels' error
    record copied in the same transfer (``None`` on a CPU device: read directly).
    """

    reqs: list[Request]
    logprobs: torch.Tensor
    choice: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    errors: torch.Tensor | None = None


class Runtime:
    """Reference hybrid runtime over one :class:`NemotronH` model.

    Parameters
    ----------
    model : NemotronH
        Loaded model (its parameters decide device and dtype).
    options : RuntimeOptions
    """

    def __init__(self, model: NemotronH, options: RuntimeOptions | None = None) -> None:
        opts = options if options is not None else RuntimeOptions()
        cfg = model.config
        if opts.track_interval % cfg.chunk_size:
            raise ValueError(
                f"RuntimeOptions.track_interval must be a multiple of the model's chunk_size "
                f"{cfg.chunk_size}, got {opts.track_interval}"
            )
        # Every rule of the options alone was checked when they were built.
        param = model.embeddings.weight
        self.model = model
        self.options = opts
        self.device = param.device
        max_bs = opts.max_decode_bs if opts.max_decode_bs is not None else opts.num_working
        spec = opts.spec_tokens + 1 if opts.spec_tokens else 0
        self.pool = StatePool.allocate(
            cfg,
            num_working=opts.num_working,
            num_track=opts.num_track,
            # a verify writes the KV of up to spec_tokens drafts past a full sequence
            max_len=opts.max_len + opts.spec_tokens,
            device=param.device,
            dtype=param.dtype,
            verify_rows=max(max_bs, opts.num_working) if spec else 0,
            verify_tokens=spec,
        )
        self.working = SlotAllocator(0, opts.num_working, "working")
        self.cache = PrefixCache(
            SlotAllocator(opts.num_working, opts.num_track, "track"), opts.track_interval
        )
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        if opts.use_graphs and spec:
            self.verify_graphs = VerifyGraphs(model, self.pool, max_bs=max_bs, max_draft=spec)
            self.verify_graphs.capture()
        elif opts.use_graphs:
            self.graphs = DecodeGraphs(model, self.pool, max_bs=max_bs)
            self.graphs.capture()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        # The host plan of the last decode step without a track save, keyed by its rows'
        # slots: such a plan does not depend on the rows' positions, so the next step with
        # the same rows reuses it instead of planning again (steady decode).
        self._decode_plan: tuple[tuple[int, ...], MixedHostPlan] | None = None
        # The last decode step's tokens while they are still on the device.
        self._pending: _PendingTokens | None = None
        self.overlapped_steps = 0
        self.finished: dict[int, Finished] = {}
        self._next_rid = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.prefill_tokens = 0
        self.cached_prompt_tokens = 0
        self.prompt_tokens = 0
        self.verify_steps = 0
        self.verify_rows = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0

    @property
    def backend_name(self) -> str:
        """The decode graphs' backend (``"none"`` without graphs)."""
        g = self.verify_graphs if self.verify_graphs is not None else self.graphs
        return g.backend_name if g is not None else "none"

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones (0 without drafts)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        forced: Sequence[int] | None = None,
    ) -> int:
        """Queue a request; returns its id.

        Parameters
        ----------
        forced : sequence of int, optional
            Output tokens to use instead of sampling (teacher forcing), one per new token.

        Raises
        ------
        ValueError
            Empty prompt, token ids outside the vocabulary, ``max_new_tokens < 1``, a
            sequence longer than ``max_len``, or ``forced`` of the wrong length.
        """
        vocab = self.model.config.vocab_size
        toks = tuple(int(t) for t in prompt)
        if not toks:
            raise ValueError("Runtime.submit: prompt must not be empty")
        if any(not 0 <= t < vocab for t in toks):
            raise ValueError(f"Runtime.submit: prompt token ids must lie in [0, {vocab})")
        if max_new_tokens < 1:
            raise ValueError(f"Runtime.submit: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(toks) + max_new_tokens > self.options.max_len:
            raise ValueError(
                f"Runtime.submit: prompt ({len(toks)}) + max_new_tokens ({max_new_tokens}) must be "
                f"<= max_len {self.options.max_len}"
            )
        fixed: tuple[int, ...] | None = None
        if forced is not None:
            fixed = tuple(int(t) for t in forced)
            if len(fixed) != max_new_tokens or any(not 0 <= t < vocab for t in fixed):
                raise ValueError(
                    f"Runtime.submit: forced must hold max_new_tokens={max_new_tokens} token ids "
                    f"in [0, {vocab}), got {len(fixed)}"
                )
        rid = self._next_rid
        self._next_rid += 1
        self._waiting.append(Request(rid, toks, max_new_tokens, fixed, list(toks)))
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _admit(self) -> None:
        while self._waiting and self.working.num_free:
            req = self._waiting.popleft()
            req.slot = self.working.allocate()
            self.prompt_tokens += len(req.prompt)
            # leave at least one prompt token to prefill: its logits give the first output
            hit = None
            if self.options.use_prefix_cache:
                hit = self.cache.lookup(req.prompt, max_boundary=len(req.prompt) - 1)
            if hit is not None:
                boundary, track_slot = hit
                self.pool.copy_slots(self._index([track_slot]), self._index([req.slot]))
                req.num_computed = boundary
                req.cached_tokens = boundary
                self.cached_prompt_tokens += boundary
            self._running.append(req)

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    # ---------------------------------------------------------------------- step

    def step(self) -> StepStats:
        """Run one mixed batch; see the module docstring.

        The phases, each a method: admit (:meth:`_admit`), plan the prefill rows and
        their track slots (:meth:`_prefill_rows`), forward the prefill rows
        (:meth:`_forward_prefill`) and the decode rows (:meth:`_decode`, or
        :meth:`_verify` with speculative decoding), sample (:meth:`_sample`, or
        :meth:`_keep` when the tokens stay on the device), retire (:meth:`_publish` the
        step's cache entries, :meth:`_retire` the finished requests).
        """
        t0 = time.perf_counter()
        self._admit()
        rows, chunk_ids, tracks, commits = self._prefill_rows()
        # rows were taken from prefilling requests only, so none of them is here
        dec_reqs = [r for r in self._running if not r.prefilling]
        pending = self._chained_pending(bool(rows), dec_reqs)

        sample_reqs: list[Request] = []
        sample_logits: list[torch.Tensor] = []
        with torch.no_grad():
            if rows:
                self._forward_prefill(rows, chunk_ids, tracks, sample_reqs, sample_logits)
            verified: _Verified | None = None
            t_decode: float | None = None
            if dec_reqs and self.options.spec_tokens:
                verified = self._verify(dec_reqs)
            elif dec_reqs:
                t_decode = self._decode(dec_reqs, sample_reqs, sample_logits, commits, pending)
            if pending is not None:
                # this step's forward is queued: only now wait for the last step's tokens
                self._land(pending)
                self.overlapped_steps += 1
            if verified is None and not rows and self._defers(dec_reqs):
                self._pending = self._keep(sample_reqs, sample_logits)
            else:
                self._sample(sample_reqs, sample_logits, verified, commits)
            if t_decode is not None and self._overlaps():
                # from this step's plan to its sampled tokens (or the last step's, when
                # this step leaves its own on the device): in a run of overlapped steps,
                # the wall time per step
                self.decode_seconds += time.perf_counter() - t_decode
        self._publish(commits)
        self._retire()
        return StepStats(
            prefill_rows=len(rows),
            prefill_tokens=len(chunk_ids),
            decode_rows=len(dec_reqs),
            tracks_saved=len(commits),
            seconds=time.perf_counter() - t0,
        )

    def _prefill_rows(
        self,
    ) -> tuple[
        list[tuple[Request, int, int]],
        list[int],
        list[tuple[int, int]],
        list[tuple[tuple[int, ...], int]],
    ]:
        """The step's prefill rows within the token budget, and their track slots.

        Returns ``(rows, chunk_ids, tracks, commits)``: ``(request, start, new tokens)``
        per row, the rows' token ids concatenated, ``(row, track slot)`` of each row that
        saves a boundary (its last one reached this step: the planner saves only that),
        and the cache entries to publish once the step ran. A prompt longer than the
        budget is split on a track boundary, so that the next chunk starts on one.
        """
        interval = self.options.track_interval
        budget = self.options.max_prefill_tokens
        rows: list[tuple[Request, int, int]] = []  # request, start, new tokens
        chunk_ids: list[int] = []
        tracks: list[tuple[int, int]] = []  # (row, track slot)
        commits: list[tuple[tuple[int, ...], int]] = []
        for req in self._running:
            if not req.prefilling or budget <= 0:
                continue
            remaining = len(req.prompt) - req.num_computed
            # a split must end on a track boundary so the next chunk starts on one
            take = remaining if remaining <= budget else (budget // interval) * interval
            if take == 0:
                continue
            start = req.num_computed
            end = start + take
            budget -= take
            chunk_ids.extend(req.prompt[start:end])
            # the planner saves each row's last boundary reached this step
            last = (end // interval) * interval
            if self.options.use_prefix_cache and last > start:
                key = req.prompt[:last]
                slot = self.cache.reserve(key)
                if slot is not None:
                    tracks.append((len(rows), slot))
                    commits.append((key, slot))
            rows.append((req, start, take))
        return rows, chunk_ids, tracks, commits

    def _chained_pending(self, prefills: bool, dec_reqs: list[Request]) -> _PendingTokens | None:
        """The last step's tokens, if they are still on the device and this step feeds
        them to its forward there: only if it decodes exactly those rows and saves no
        track (a track's cache key holds them). Otherwise they land on the host now."""
        pending, self._pending = self._pending, None
        if pending is not None and (prefills or not self._chains(pending, dec_reqs)):
            self._land(pending)
            pending = None
        return pending

    def _forward_prefill(
        self,
        rows: list[tuple[Request, int, int]],
        chunk_ids: list[int],
        tracks: list[tuple[int, int]],
        sample_reqs: list[Request],
        sample_logits: list[torch.Tensor],
    ) -> None:
        """The prefill rows' forward (:meth:`_prefill`); each row whose prompt is done
        joins the step's sampling with its last-token log-probabilities."""
        logits = self._prefill(rows, chunk_ids, tracks)
        done_rows = []
        for i, (req, start, take) in enumerate(rows):
            req.num_computed = start + take
            if not req.prefilling:
                done_rows.append(i)
                sample_reqs.append(req)
        if done_rows:
            sample_logits.append(logits[self._index(done_rows)].float().log_softmax(-1))
        self.prefill_tokens += len(chunk_ids)

    def _plan(
        self,
        starts: Sequence[int],
        lengths: Sequence[int],
        slots: Sequence[int],
        tracks: Sequence[tuple[int, int]],
        *,
        num_decodes: int,
    ) -> MixedHostPlan:
        """The forward's host plan: the runtime's rows through the library's planner."""
        cfg = self.model.config
        tracked = dict(tracks)
        track_mask = track_slots = None
        if self.options.use_prefix_cache:
            track_mask = [i in tracked for i in range(len(slots))]
            track_slots = [tracked.get(i, -1) for i in range(len(slots))]
        return plan_host(
            extend_lens=lengths,
            prefix_lens=starts,
            slots=slots,
            num_decodes=num_decodes,
            chunk_size=cfg.chunk_size,
            conv_kernel=cfg.conv_kernel,
            track_interval=self.options.track_interval,
            track_mask=track_mask,
            track_slots=track_slots,
        )

    def _prefill(
        self,
        rows: list[tuple[Request, int, int]],
        chunk_ids: list[int],
        tracks: list[tuple[int, int]],
    ) -> torch.Tensor:
        """One forward of the step's prefill rows; returns ``[P, V]`` last-token logits."""
        starts = [start for _, start, _ in rows]
        lengths = [take for _, _, take in rows]
        slots = [_slot(req) for req, _, _ in rows]
        hp = self._plan(starts, lengths, slots, tracks, num_decodes=0)
        ah = attention_host_plan(lengths, starts)
        views = to_device_packed(
            {
                **hp.arrays,
                **ah.arrays,
                "input_ids": np.asarray(chunk_ids),
                **self._kv_copy_arrays(slots, tracks),
            },
            self.device,
            as_bool=BOOL_PARTS,
        )
        logits = self.model.forward_prefill(
            views["input_ids"], hp.metadata(views), ah.plan(views), self.pool
        )
        if tracks:
            # the layers saved conv/SSM state of the boundaries; the KV rows follow
            self.pool.copy_kv(views["kv_src"], views["kv_dst"])
        return logits

    def _overlaps(self) -> bool:
        opts = self.options
        return opts.overlap_decode and not opts.sync_timing and not opts.spec_tokens

    def _defers(self, reqs: list[Request]) -> bool:
        """Whether a decode-only step leaves its tokens on the device: overlap is on and
        every row keeps decoding after this token (a finishing row's tokens are needed on
        the host to retire it this step)."""
        return (
            self._overlaps()
            and bool(reqs)
            and all(r.num_generated + 1 < r.max_new_tokens for r in reqs)
        )

    def _chains(self, pending: _PendingTokens, reqs: list[Request]) -> bool:
        """Whether a decode-only step of ``reqs`` can take ``pending``'s tokens as its
        inputs on the device: the same rows, in the same order, and no track saved (its
        cache key would hold the pending tokens)."""
        if len(reqs) != len(pending.reqs) or any(
            a is not b for a, b in zip(reqs, pending.reqs, strict=True)
        ):
            return False
        if not self.options.use_prefix_cache:
            return True
        interval = self.options.track_interval
        return all((r.num_computed + 1) % interval for r in reqs)

    def _keep(self, reqs: list[Request], logprobs: list[torch.Tensor]) -> _PendingTokens:
        """Sample a decode step's tokens on the device and start their copy to the host."""
        (logp,) = logprobs
        choice = logp.argmax(-1)
        if any(r.forced is not None for r in reqs):
            forced = [r.forced[r.num_generated] if r.forced is not None else -1 for r in reqs]
            fixed = self._index(forced)
            choice = torch.where(fixed >= 0, fixed, choice)
        if self.device.type != "cuda":
            return _PendingTokens(reqs=reqs, logprobs=logp, choice=choice, host=choice, ready=None)
        host = torch.empty(choice.shape, dtype=choice.dtype, pin_memory=True)
        host.copy_(choice, non_blocking=True)
        # the kernels' error record rides along (read when the tokens land: no extra sync)
        errors = torch.empty(4, dtype=torch.int64, pin_memory=True)
        errors.copy_(kernels.error_record(self.device), non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return _PendingTokens(
            reqs=reqs, logprobs=logp, choice=choice, host=host, ready=ready, errors=errors
        )

    def _land(self, pending: _PendingTokens) -> None:
        """Wait for a decode step's tokens and append them to their requests."""
        if pending.ready is not None:
            pending.ready.synchronize()
        # an invalid slot id a kernel met on the device (its rows wrote nothing): raise here
        errors = None if pending.errors is None else pending.errors.tolist()
        kernels.raise_if_faulted(self.device, values=errors)
        tokens: list[int] = pending.host.tolist()
        for i, req in enumerate(pending.reqs):
            req.logprobs.append(pending.logprobs[i])
            req.tokens.append(tokens[i])

    @staticmethod
    def _kv_copy_arrays(
        slots: Sequence[int], tracks: Sequence[tuple[int, int]]
    ) -> dict[str, npt.NDArray[np.int64]]:
        """The KV rows a step's track saves copy (row's working slot -> track slot), staged
        with the step's other arrays; none when nothing is tracked."""
        if not tracks:
            return {}
        return {
            "kv_src": np.asarray([slots[r] for r, _ in tracks], dtype=np.int64),
            "kv_dst": np.asarray([t for _, t in tracks], dtype=np.int64),
        }

    def _decode(
        self,
        reqs: list[Request],
        sample_reqs: list[Request],
        sample_logits: list[torch.Tensor],
        commits: list[tuple[tuple[int, ...], int]],
        pending: _PendingTokens | None = None,
    ) -> float:
        """Decode rows: one token each, through the captured step (or eagerly); returns the
        ``perf_counter`` time its host work started.

        A row whose length reaches a multiple of the interval with this token reserves a
        track slot; the planner flags it in ``mamba_track_mask`` and the step's track-save
        stores its Mamba state there; its attention KV row is copied after the step.
        With ``pending`` (the last step's tokens, still on the device, of the same rows),
        those are the input ids and the step never waits for the device.
        """
        slots, tracks = self._decode_tracks(reqs, commits)
        self._sync()
        td = time.perf_counter()
        pos_host = [r.num_computed for r in reqs]
        hp = self._decode_host_plan(pos_host, slots, tracks)
        # one host-to-device copy for the metadata and the per-row inputs
        host_ids = {} if pending is not None else {
            "input_ids": np.asarray([r.tokens[r.num_computed] for r in reqs])
        }  # fmt: skip
        views = to_device_packed(
            {
                **hp.arrays,
                **host_ids,
                "positions": np.asarray(pos_host),
                **self._kv_copy_arrays(slots, tracks),
            },
            self.device,
            as_bool=BOOL_PARTS,
        )
        ids = pending.choice if pending is not None else views["input_ids"]
        pos = views["positions"]
        if self.graphs is not None:
            logits = self.graphs.run(hp.forward(views), ids, pos)
        else:
            logits = self.model.forward_decode(ids, pos, hp.metadata(views), self.pool)
        sample_logits.append(logits.float().log_softmax(-1))
        if tracks:
            self.pool.copy_kv(views["kv_src"], views["kv_dst"])
        sample_reqs.extend(reqs)
        self.decode_tokens += len(reqs)
        for r in reqs:
            r.num_computed += 1
        if not self._overlaps():
            # overlapped, the step counts its decode time once its tokens are sampled
            self._sync()
            self.decode_seconds += time.perf_counter() - td
        return td

    def _decode_tracks(
        self, reqs: list[Request], commits: list[tuple[tuple[int, ...], int]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The decode rows' working slots, and ``(row, track slot)`` of each row whose
        length reaches a multiple of the interval with this token (its cache entry joins
        ``commits``)."""
        interval = self.options.track_interval
        slots: list[int] = []
        tracks: list[tuple[int, int]] = []
        for i, r in enumerate(reqs):
            assert r.slot is not None
            slots.append(r.slot)
            n_after = r.num_computed + 1
            if self.options.use_prefix_cache and n_after % interval == 0:
                key = tuple(r.tokens[:n_after])
                slot = self.cache.reserve(key)
                if slot is not None:
                    commits.append((key, slot))
                    tracks.append((i, slot))
        return slots, tracks

    def _decode_host_plan(
        self, pos_host: list[int], slots: list[int], tracks: list[tuple[int, int]]
    ) -> MixedHostPlan:
        """The decode step's host plan: the last one when its rows (slots) are this
        step's and neither saves a track (such a plan does not depend on positions)."""
        key = tuple(slots)
        cached = self._decode_plan
        if not tracks and cached is not None and cached[0] == key:
            return cached[1]
        hp = self._plan(pos_host, [1] * len(slots), slots, tracks, num_decodes=len(slots))
        self._decode_plan = None if tracks else (key, hp)
        return hp

    def _verify(self, reqs: list[Request]) -> _Verified:
        """Decode rows, speculatively: draft, verify, accept and commit on the device.

        A row whose state may cross a track boundary with its pending token and draft
        reserves a track slot under the key it would have if the draft were accepted; the
        commit saves the boundary token's state there only if the accepted tokens reach
        the boundary (:func:`hybridmeta.kernels.spec_track_token`), and the host publishes
        the entry (and copies its KV rows) only then.
        """
        opts = self.options
        drafted = self._draft(reqs)
        self._sync()
        td = time.perf_counter()
        track_mask = track_slots = None
        tracked = drafted.tracked
        if opts.use_prefix_cache:
            track_mask = [i in tracked for i in range(len(reqs))]
            track_slots = [tracked[i][1] if i in tracked else -1 for i in range(len(reqs))]
        plan = plan_spec_step(
            slots=drafted.slots, seq_lens=drafted.seq_lens, tokens=drafted.rows,
            targets=drafted.targets, num_draft=drafted.draft_lens, track_mask=track_mask,
            track_slots=track_slots,
        )  # fmt: skip
        staged = to_device_packed(plan.staged_arrays, self.device)
        v = plan.views(staged)
        fwd = plan.verify.forward(staged)
        md = prepare_target_verify(fwd)
        if self.verify_graphs is not None:
            logits = self.verify_graphs.verify(fwd, v["input_ids"], v["positions"])
        else:
            logits = self.model.forward_verify(v["input_ids"], v["positions"], md, self.pool)
        acc = greedy_accept(logits, v["input_ids"], v["targets"], v["num_draft"])
        cmd = prepare_commit(
            md,
            accepted_index=acc.num_accepted,
            track_token=kernels.spec_track_token(
                v["seq_lens"], acc.num_accepted + 1, opts.track_interval
            ),
        )
        if self.verify_graphs is not None:
            self.verify_graphs.commit(cmd)
        else:
            inter_conv, inter_ssm = self.pool.verify_states(len(reqs), drafted.num_tokens)
            kernels.spec_commit_from_metadata(
                cmd, self.pool.conv, self.pool.ssm, inter_conv, inter_ssm
            )
        self._sync()
        self.decode_seconds += time.perf_counter() - td
        return _Verified(
            reqs=reqs,
            accepted=acc,
            draft_lens=drafted.draft_lens,
            seq_lens=drafted.seq_lens,
            tracked=tracked,
        )

    def _draft(self, reqs: list[Request]) -> _Drafts:
        """The verify step's rows: each row's draft (prompt lookup, within its remaining
        tokens), its pending token and draft padded to the step's ``T`` tokens, its
        teacher-forced targets, and a track slot for each row that may cross a boundary."""
        opts = self.options
        interval = opts.track_interval
        drafts: list[list[int]] = []
        for r in reqs:
            room = min(opts.spec_tokens, r.max_new_tokens - r.num_generated - 1)
            drafts.append(ngram_draft(r.tokens, room, max_ngram=opts.spec_ngram))
        T = 1 + max(len(d) for d in drafts)
        slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[list[int]] = []
        targets: list[list[int]] = []
        tracked: dict[int, tuple[tuple[int, ...], int, int]] = {}
        for i, (r, d) in enumerate(zip(reqs, drafts, strict=True)):
            assert r.slot is not None
            s = r.num_computed  # the pending token r.tokens[s] is not in the state yet
            slots.append(r.slot)
            seq_lens.append(s)
            row = [r.tokens[s], *d]
            rows.append(row + [row[-1]] * (T - len(row)))
            g = r.num_generated
            forced = r.forced
            targets.append(
                [forced[g + j] if forced is not None and g + j < len(forced) else -1
                 for j in range(T)]
            )  # fmt: skip
            boundary = ((s + 1 + len(d)) // interval) * interval
            if opts.use_prefix_cache and boundary > s:
                key = tuple([*r.tokens, *d][:boundary])
                slot = self.cache.reserve(key)
                if slot is not None:
                    tracked[i] = (key, slot, boundary)
        return _Drafts(
            num_tokens=T,
            slots=slots,
            seq_lens=seq_lens,
            rows=rows,
            targets=targets,
            draft_lens=[len(d) for d in drafts],
            tracked=tracked,
        )

    def _apply_verified(
        self, ver: _Verified, host: list[int], commits: list[tuple[tuple[int, ...], int]]
    ) -> None:
        """Append each row's accepted drafts and bonus token; publish crossed boundaries."""
        bs = len(ver.reqs)
        T = ver.accepted.choice.shape[1]
        choice, ks = host[: bs * T], host[bs * T :]
        kv_src: list[int] = []
        kv_dst: list[int] = []
        for i, r in enumerate(ver.reqs):
            k = ks[i]
            for j in range(k + 1):
                r.logprobs.append(ver.accepted.logprobs[i, j])
                r.tokens.append(choice[i * T + j])
            r.num_computed += k + 1
            self.decode_tokens += k + 1
            self.accepted_tokens += k
            self.drafted_tokens += ver.draft_lens[i]
            hit = ver.tracked.get(i)
            if hit is not None and hit[2] <= ver.seq_lens[i] + k + 1:
                # the commit saved the boundary's state; its KV rows follow
                assert r.slot is not None
                kv_src.append(r.slot)
                kv_dst.append(hit[1])
                commits.append((hit[0], hit[1]))
        if kv_src:
            self.pool.copy_kv(self._index(kv_src), self._index(kv_dst))
        self.verify_steps += 1
        self.verify_rows += bs

    def _sync(self) -> None:
        if self.options.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sample(
        self,
        reqs: list[Request],
        logprobs: list[torch.Tensor],
        verified: _Verified | None = None,
        commits: list[tuple[tuple[int, ...], int]] | None = None,
    ) -> None:
        parts: list[torch.Tensor] = []
        logp: torch.Tensor | None = None
        if reqs:
            logp = torch.cat(logprobs) if len(logprobs) > 1 else logprobs[0]  # [R, V]
            if any(r.forced is None for r in reqs):
                # the argmax of every row (R ints; teacher-forced rows ignore theirs)
                parts.append(logp.argmax(-1))
        n_greedy = parts[0].shape[0] if parts else 0
        if verified is not None:
            parts += [verified.accepted.choice.reshape(-1), verified.accepted.num_accepted]
        # the step's one device-to-host transfer, the kernels' error record included (an
        # invalid slot id a kernel met on the device, its rows wrote nothing: raise here)
        record = kernels.error_record(self.device)
        got: list[int] = torch.cat([*(p.long() for p in parts), record]).tolist()
        kernels.raise_if_faulted(self.device, values=got[-4:])
        host = got[:-4]
        greedy = host[:n_greedy]
        if verified is not None:
            assert commits is not None
            self._apply_verified(verified, host[n_greedy:], commits)
        if logp is None:
            return
        for i, req in enumerate(reqs):
            req.logprobs.append(logp[i])
            if req.forced is not None:
                req.tokens.append(req.forced[req.num_generated])
            else:
                req.tokens.append(greedy[i])

    def _publish(self, commits: list[tuple[tuple[int, ...], int]]) -> None:
        """Publish the step's cache entries (their states were saved during the step)."""
        for key, slot in commits:
            self.cache.commit(key, slot)
        self.cache.end_step()

    def _retire(self) -> None:
        keep: list[Request] = []
        for req in self._running:
            if req.num_generated >= req.max_new_tokens:
                assert req.slot is not None
                self.working.free(req.slot)
                req.slot = None
                self.finished[req.rid] = Finished(
                    rid=req.rid,
                    prompt=req.prompt,
                    output=tuple(req.tokens[len(req.prompt) :]),
                    logprobs=torch.stack(req.logprobs).float(),
                    cached_tokens=req.cached_tokens,
                )
            else:
                keep.append(req)
        self._running = keep

    def run(self, *, on_step: Callable[[StepStats], None] | None = None) -> dict[int, Finished]:
        """Step until every submitted request has finished; returns them by id."""
        while self.has_work:
            stats = self.step()
            if on_step is not None:
                on_step(stats)
        return self.finished


def _slot(req: Request) -> int:
    assert req.slot is not None  # running requests hold a working slot
    return req.slot


def cold_logits(model: NemotronH, tokens: Sequence[int]) -> torch.Tensor:
    """Logits at every position of ``tokens`` from one fresh prefill (no cache, no graphs).

    Returns
    -------
    torch.Tensor
        ``[len(tokens), V]`` fp32; row ``i`` predicts token ``i + 1``.
    """
    device = model.embeddings.weight.device
    pool = StatePool.allocate(
        model.config,
        num_working=1,
        num_track=0,
        max_len=len(tokens),
        device=device,
        dtype=model.embeddings.weight.dtype,
    )
    n = len(tokens)
    hp = plan_host(
        extend_lens=[n],
        prefix_lens=[0],
        slots=[0],
        num_decodes=0,
        chunk_size=model.config.chunk_size,
        conv_kernel=model.config.conv_kernel,
    )
    ah = attention_host_plan([n], [0])
    views = to_device_packed({**hp.arrays, **ah.arrays, "input_ids": np.asarray(tokens)}, device)
    with torch.no_grad():
        return model.forward_prefill(
            views["input_ids"], hp.metadata(views), ah.plan(views), pool, all_logits=True
        )
