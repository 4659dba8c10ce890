"""The reference hybrid runtime: a step loop over mixed prefill/decode batches.

Each :meth:`Runtime.step`

1. admits waiting requests while working slots are free (a request that finds none
   waits in the queue; live state is never overwritten). An admitted request whose
   prompt starts with a cached prefix copies the track slot (conv + SSM state and the
   attention KV) into its working slot and prefills only the rest;
2. forms a mixed batch, prefill rows first and decode rows last, and decides its track
   plan from host data: which rows reach a track boundary and into which track slot.
   Prefill rows run through the prefill plan and the chunked scan
   (:mod:`hybridmeta.prefill` by default), which also saves their boundaries. Decode rows
   run through the captured step of their bucket (:class:`DecodeGraphs`: metadata from
   ``prepare_decode``, ``GraphRunner`` over ``StaticBuffers``), whose track-save reads
   ``mamba_track_mask`` / ``mamba_track_indices``; or eagerly, for the comparison;
3. copies the attention KV rows of the saved boundaries, samples (greedy, or
   teacher-forced tokens) and publishes the step's cache entries.

All plans are computed from host-side data (lengths, slots, token lists) of the step's own
inputs. The only device-to-host transfer is the step's sampled tokens, once per step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import torch

from hybridmeta.model import prepare_decode
from hybridmeta.runtime.decode_graphs import DecodeGraphs, decode_metadata, decode_step
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.plan import (
    PrefillPlan,
    PrefillRow,
    TrackTarget,
    build_prefill_plan,
)
from hybridmeta.runtime.prefix_cache import PrefixCache
from hybridmeta.runtime.state import SlotAllocator, StatePool

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
        only; it adds two host syncs per step).
    prefill_backend : {"torch", "hybridmeta"}
        Mamba prefill through the padded per-row torch scan (saves every boundary a
        prefill crosses) or through :mod:`hybridmeta.prefill` (planner + chunked scan on
        the global grid + extend track-save; saves the last boundary of each row).
    decode_kernels : {"torch", "triton"}
        Mamba decode ops: pure torch, or the Triton kernels of :mod:`hybridmeta.kernels`
        (the Triton interpreter on the CPU: slow, for tests).
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
    prefill_backend: str = "hybridmeta"
    decode_kernels: str = "torch"


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
        if opts.max_prefill_tokens < opts.track_interval:
            raise ValueError(
                f"RuntimeOptions.max_prefill_tokens must be >= track_interval "
                f"{opts.track_interval}, got {opts.max_prefill_tokens}"
            )
        if opts.prefill_backend not in ("torch", "hybridmeta"):
            raise ValueError(
                f"RuntimeOptions.prefill_backend must be 'torch' or 'hybridmeta', "
                f"got {opts.prefill_backend!r}"
            )
        if opts.decode_kernels not in ("torch", "triton"):
            raise ValueError(
                f"RuntimeOptions.decode_kernels must be 'torch' or 'triton', "
                f"got {opts.decode_kernels!r}"
            )
        if opts.num_track < 1:
            raise ValueError(f"RuntimeOptions.num_track must be >= 1, got {opts.num_track}")
        param = model.embeddings.weight
        self.model = model
        self.options = opts
        self.device = param.device
        self.pool = StatePool.allocate(
            cfg,
            num_working=opts.num_working,
            num_track=opts.num_track,
            max_len=opts.max_len,
            device=param.device,
            dtype=param.dtype,
        )
        self.working = SlotAllocator(1, opts.num_working, "working")
        self.cache = PrefixCache(
            SlotAllocator(1 + opts.num_working, opts.num_track, "track"), opts.track_interval
        )
        self.graphs: DecodeGraphs | None = None
        if opts.use_graphs:
            self.graphs = DecodeGraphs(
                model,
                self.pool,
                max_bs=opts.max_decode_bs if opts.max_decode_bs is not None else opts.num_working,
                kernels=opts.decode_kernels,
            )
            self.graphs.capture()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self.finished: dict[int, Finished] = {}
        self._next_rid = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.prefill_tokens = 0
        self.cached_prompt_tokens = 0
        self.prompt_tokens = 0

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
        """Run one mixed batch; see the module docstring."""
        t0 = time.perf_counter()
        self._admit()
        interval = self.options.track_interval
        budget = self.options.max_prefill_tokens
        rows: list[PrefillRow] = []
        row_reqs: list[Request] = []
        chunk_ids: list[int] = []
        tracks: list[TrackTarget] = []
        commits: list[tuple[tuple[int, ...], int]] = []
        for req in self._running:
            if not req.prefilling or budget <= 0:
                continue
            remaining = len(req.prompt) - req.num_computed
            # a split must end on a track boundary so the next chunk starts on one
            take = remaining if remaining <= budget else (budget // interval) * interval
            if take == 0:
                continue
            assert req.slot is not None
            start = req.num_computed
            end = start + take
            budget -= take
            row = len(rows)
            rows.append(
                PrefillRow(slot=req.slot, start=start, length=take, has_initial_state=start > 0)
            )
            row_reqs.append(req)
            chunk_ids.extend(req.prompt[start:end])
            first = math.ceil((start + 1) / interval) * interval
            bounds = list(range(first, end + 1, interval)) if self.options.use_prefix_cache else []
            if self.options.prefill_backend == "hybridmeta":
                bounds = bounds[-1:]  # the planner saves the last boundary of a row
            for b in bounds:
                key = req.prompt[:b]
                slot = self.cache.reserve(key)
                if slot is not None:
                    tracks.append(TrackTarget(row=row, boundary=b, slot=slot))
                    commits.append((key, slot))
        # rows were taken from prefilling requests only, so none of them is here
        dec_reqs = [r for r in self._running if not r.prefilling]

        sample_reqs: list[Request] = []
        sample_logits: list[torch.Tensor] = []
        with torch.no_grad():
            if rows:
                plan = self._prefill_plan(rows, tracks)
                logits = self.model.forward_prefill(self._index(chunk_ids), plan, self.pool)
                if tracks:
                    # the scan wrote conv/SSM state of the boundaries; the KV rows follow
                    self.pool.copy_kv(
                        self._index([rows[t.row].slot for t in tracks]),
                        self._index([t.slot for t in tracks]),
                    )
                done_rows = []
                for i, (prow, req) in enumerate(zip(rows, row_reqs, strict=True)):
                    req.num_computed = prow.start + prow.length
                    if not req.prefilling:
                        done_rows.append(i)
                        sample_reqs.append(req)
                if done_rows:
                    sample_logits.append(logits[self._index(done_rows)].float().log_softmax(-1))
                self.prefill_tokens += len(chunk_ids)
            if dec_reqs:
                self._decode(dec_reqs, sample_reqs, sample_logits, commits)
            self._sample(sample_reqs, sample_logits)
        for key, slot in commits:
            self.cache.commit(key, slot)
        self.cache.end_step()
        self._retire()
        return StepStats(
            prefill_rows=len(rows),
            prefill_tokens=len(chunk_ids),
            decode_rows=len(dec_reqs),
            tracks_saved=len(commits),
            seconds=time.perf_counter() - t0,
        )

    def _decode(
        self,
        reqs: list[Request],
        sample_reqs: list[Request],
        sample_logits: list[torch.Tensor],
        commits: list[tuple[tuple[int, ...], int]],
    ) -> None:
        """Decode rows: one token each, through the captured step (or eagerly).

        The track plan is decided before the forward from host data: a row whose length
        reaches a multiple of the interval with this token saves its Mamba state into a
        track slot inside the step (``mamba_track_mask`` / ``mamba_track_indices``); its
        attention KV row is copied after the step.
        """
        interval = self.options.track_interval
        slots: list[int] = []
        track_slots: list[int] = []
        for r in reqs:
            assert r.slot is not None
            slots.append(r.slot)
            slot = None
            n_after = r.num_computed + 1
            if self.options.use_prefix_cache and n_after % interval == 0:
                key = tuple(r.tokens[:n_after])
                slot = self.cache.reserve(key)
                if slot is not None:
                    commits.append((key, slot))
            track_slots.append(-1 if slot is None else slot)
        self._sync()
        td = time.perf_counter()
        # one host-to-device copy for the per-row inputs; the rows are contiguous views
        ids_host = [r.tokens[r.num_computed] for r in reqs]
        pos_host = [r.num_computed for r in reqs]
        packed = torch.tensor([ids_host, pos_host, slots, track_slots], dtype=torch.int64)
        ids, pos, dslots, tslots = packed.to(self.device, non_blocking=True)
        fwd = decode_metadata(dslots, tslots, tslots >= 0)
        if self.graphs is not None:
            logits = self.graphs.run(fwd, ids, pos)
        else:
            out = decode_step(
                self.model,
                self.pool,
                prepare_decode(fwd),
                {"input_ids": ids, "positions": pos},
                kernels=self.options.decode_kernels,
            )
            logits = out["logits"]
        sample_logits.append(logits.float().log_softmax(-1))
        tracked = [(s, t) for s, t in zip(slots, track_slots, strict=True) if t >= 0]
        if tracked:
            self.pool.copy_kv(
                self._index([s for s, _ in tracked]), self._index([t for _, t in tracked])
            )
        sample_reqs.extend(reqs)
        self.decode_tokens += len(reqs)
        for r in reqs:
            r.num_computed += 1
        self._sync()
        self.decode_seconds += time.perf_counter() - td

    def _prefill_plan(self, rows: list[PrefillRow], tracks: list[TrackTarget]) -> PrefillPlan:
        cfg = self.model.config
        if self.options.prefill_backend == "torch":
            return build_prefill_plan(rows, tracks, chunk_size=cfg.chunk_size, device=self.device)
        from hybridmeta.prefill import plan_mixed_batch

        tracked = {t.row: t.slot for t in tracks}
        mamba = plan_mixed_batch(
            extend_lens=[r.length for r in rows],
            prefix_lens=[r.start for r in rows],
            slots=[r.slot for r in rows],
            num_decodes=0,
            chunk_size=cfg.chunk_size,
            conv_kernel=cfg.conv_kernel,
            track_interval=self.options.track_interval,
            track_mask=[i in tracked for i in range(len(rows))],
            track_slots=[tracked.get(i, -1) for i in range(len(rows))],
            device=self.device,
        )
        # Mamba layers track through the planner; the attention KV copy stays with the engine
        return build_prefill_plan(
            rows, [], chunk_size=cfg.chunk_size, device=self.device, mamba=mamba
        )

    def _sync(self) -> None:
        if self.options.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sample(self, reqs: list[Request], logprobs: list[torch.Tensor]) -> None:
        if not reqs:
            return
        logp = torch.cat(logprobs) if len(logprobs) > 1 else logprobs[0]  # [R, V]
        greedy: list[int] = []
        if any(r.forced is None for r in reqs):
            # the step's one device-to-host transfer: the argmax of every row (R ints;
            # teacher-forced rows simply ignore theirs)
            greedy = logp.argmax(-1).tolist()
        for i, req in enumerate(reqs):
            req.logprobs.append(logp[i])
            if req.forced is not None:
                req.tokens.append(req.forced[req.num_generated])
            else:
                req.tokens.append(greedy[i])

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
    plan = build_prefill_plan(
        [PrefillRow(slot=1, start=0, length=len(tokens), has_initial_state=False)],
        [],
        chunk_size=model.config.chunk_size,
        device=device,
    )
    ids = torch.tensor(list(tokens), dtype=torch.int64).to(device)
    with torch.no_grad():
        return model.forward_prefill(ids, plan, pool, all_logits=True)
