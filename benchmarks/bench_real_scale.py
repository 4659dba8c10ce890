"""Real-scale decode: the Nemotron-Nano-9B-v2 architecture with random weights, one GPU.

Builds the model with ``transformers`` (``NemotronHConfig`` + ``from_config`` under
``torch.device("cuda")``, bf16; nothing is downloaded), saves it with ``save_pretrained``
(``--dir``, default ``/dev/shm``), loads it with :func:`hybridmeta.runtime.load_nemotron_h`
and measures, in one run:

* the copy ceiling (1 GiB device-to-device) and the weight-read floor of a decode step
  (bytes of all weights / ceiling), and per batch size the step floor (weights, plus each
  row's SSM / conv state read and written and its KV read, at the ceiling);
* the runtime's decode step (``Runtime`` with captured ``DecodeGraphs``, ``--kernels``
  Triton by default) at bs 1 and 16: wall time per decode-only step (host included), with
  steps overlapped (the runtime's default) and synchronous (each step waits for its own
  tokens), the host time of each piece of a step, the replay of the captured step alone
  (CUDA events), the kernels of one step and their summed GPU time (``torch.profiler``,
  graph replay and eager);
* prefill tokens/s of the runtime (one prompt of ``--prefill-len`` tokens, and 16 rows);
* decode tokens/s of ``transformers``' ``generate`` on the same model (bs 1 and 16), from
  two runs that differ only in the number of new tokens.

Writes ``real_scale_<tag>.json`` (device, versions, date, config, every figure) to ``--out``.

    PYTHONPATH=src python3 benchmarks/bench_real_scale.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

import hybridmeta
from hybridmeta.kernels import implementation
from hybridmeta.model import ForwardMetadata, prepare_decode
from hybridmeta.runtime import Runtime, RuntimeOptions, load_nemotron_h
from hybridmeta.runtime.config import NemotronHConfig as RuntimeConfig
from hybridmeta.runtime.state import StatePool

PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def nano_config(*, layers: int | None = None) -> RuntimeConfig:
    """Nemotron-Nano-9B-v2's shapes (``layers``: a prefix of the pattern, for smoke runs)."""
    return RuntimeConfig(
        vocab_size=131072,
        hidden_size=4480,
        pattern=PATTERN if layers is None else PATTERN[:layers],
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=15680,
        mamba_num_heads=128,
        mamba_head_dim=80,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
        layer_norm_epsilon=1e-5,
        use_conv_bias=True,
        use_bias=False,
        mlp_bias=False,
        time_step_min=0.001,
        tie_word_embeddings=False,
    )


def tiny_config() -> RuntimeConfig:
    """A small model of the same layer kinds (``--small``: CPU smoke run of the script)."""
    from hybridmeta.runtime.tiny import tiny_config as tiny

    return tiny(pattern="M-M*M-", chunk_size=16)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_ceiling(dev: torch.device) -> dict[str, float]:
    n = 1 << 28 if dev.type == "cuda" else 1 << 16
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        from triton.testing import do_bench

        t = float(do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")) / 1e3
    else:
        t = statistics.median(times)
    return {"bytes": 2.0 * n * 4, "seconds": t, "tbps": 2.0 * n * 4 / t / 1e12}


def build_and_save(cfg: RuntimeConfig, path: Path, dev: torch.device) -> tuple[Any, dict[str, float]]:
    """The transformers model at ``cfg`` (random weights, bf16, on ``dev``), saved to ``path``."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    hf_cfg.use_mamba_kernels = False  # the pure-torch path: the peers' kernels are not here
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    hf.eval()
    _sync(dev)
    t1 = time.perf_counter()
    if path.exists():
        shutil.rmtree(path)
    hf.save_pretrained(path)
    t2 = time.perf_counter()
    _plain_floats(path / "config.json")
    return hf, {"build_s": t1 - t0, "save_s": t2 - t1}


def _plain_floats(config_json: Path) -> None:
    """transformers 5.x writes ``time_step_limit`` as ``[0.0, {"__float__": "Infinity"}]``,
    which the runtime's config reader does not take (yet): write plain JSON floats."""
    raw = json.loads(config_json.read_text())

    def plain(v: Any) -> Any:
        if isinstance(v, dict) and set(v) == {"__float__"}:
            return float(v["__float__"])
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    config_json.write_text(json.dumps({k: plain(v) for k, v in raw.items()}, indent=2))


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run_requests(rt: Runtime, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Submit and run to completion; per-step stats split into prefill and decode-only."""
    for p in prompts:
        rt.submit(p, new_tokens)
    prefill, decode = [], []
    while rt.has_work:
        st = rt.step()
        if st.prefill_rows:
            prefill.append({"tokens": st.prefill_tokens, "rows": st.prefill_rows,
                            "decode_rows": st.decode_rows, "seconds": st.seconds})  # fmt: skip
        elif st.decode_rows:
            decode.append({"rows": st.decode_rows, "seconds": st.seconds})
    full = [d["seconds"] for d in decode if d["rows"] == len(prompts)]
    out: dict[str, Any] = {"prefill_steps": prefill, "decode_steps": len(decode)}
    if full:
        med = statistics.median(full)
        # median and mean: overlapped, the step after a synchronous one is short (its
        # predecessor's forward had already finished) and the next one is long; the mean
        # is the decode wall time over the steps, the throughput
        out |= {"decode_step_wall_ms": med * 1e3, "decode_step_wall_min_ms": min(full) * 1e3,
                "decode_step_wall_mean_ms": statistics.fmean(full) * 1e3,
                "decode_tokens_per_s": len(prompts) / med}  # fmt: skip
    ptoks = sum(p["tokens"] for p in prefill)
    psec = sum(p["seconds"] for p in prefill)
    if psec > 0:
        out["prefill_tokens_per_s"] = ptoks / psec
    return out


def step_floor(pool: StatePool, bs: int, context: int, weight_bytes_: int, tbps: float) -> dict[str, float]:
    """The bytes a decode step of ``bs`` rows at position ``context`` must move, and their
    time at the copy ceiling: the weights once, each row's SSM and conv state read and
    written once, and its attention K and V read over ``context + 1`` positions (plus the
    new position written)."""
    layers_m, _, *ssm_row = pool.ssm.shape
    _, _, *conv_row = pool.conv.shape
    layers_a, _, _, kvh, hd = pool.k.shape
    ssm = 2 * layers_m * math.prod(ssm_row) * pool.ssm.element_size()
    conv = 2 * layers_m * math.prod(conv_row) * pool.conv.element_size()
    kv = 2 * layers_a * (context + 2) * kvh * hd * pool.k.element_size()
    total = weight_bytes_ + bs * (ssm + conv + kv)
    return {"bytes": total, "state_bytes_per_row": ssm + conv, "kv_bytes_per_row": kv,
            "floor_ms": total / tbps / 1e9}  # fmt: skip


@contextlib.contextmanager
def host_breakdown(rt: Runtime) -> Iterator[dict[str, list[float]]]:
    """Host seconds of the decode step's pieces (the runtime's plan, the packed
    host-to-device copy, the graph buffers' refresh, the replay call, the sampling), one
    list per piece, while the block runs; the functions are restored after it."""
    import hybridmeta.runtime.engine as engine

    assert rt.graphs is not None
    times: dict[str, list[float]] = {}
    targets: list[tuple[Any, str, str]] = [
        (rt, "_plan", "plan"), (engine, "to_device_packed", "pack"),
        (rt.graphs.runner.buffers, "refresh", "refresh"), (rt.graphs, "run", "graphs.run"),
        (rt, "_sample", "sample"), (rt, "_keep", "keep"), (rt, "_land", "land"),
    ]  # fmt: skip
    saved = []
    for obj, name, label in targets:
        fn = getattr(obj, name)
        saved.append((obj, name, fn, name in vars(obj)))

        def timed(*a: Any, _fn: Any = fn, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times.setdefault(_label, []).append(time.perf_counter() - t0)

        setattr(obj, name, timed)
    try:
        yield times
    finally:
        for obj, name, fn, own in saved:
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)


def make_replay(rt: Runtime, bs: int, position: int) -> Callable[[], torch.Tensor]:
    """One replay of the captured decode step of bucket ``bs`` on slots ``0..bs-1``, every
    row at ``position`` (its attention reads ``position + 1`` keys)."""
    assert rt.graphs is not None
    graphs = rt.graphs
    dev = rt.device
    ids = torch.full((bs,), 5, dtype=torch.int64, device=dev)
    pos = torch.full((bs,), position, dtype=torch.int64, device=dev)
    return lambda: graphs.run(_decode_forward(bs, dev), ids, pos)


def _decode_forward(bs: int, dev: torch.device) -> ForwardMetadata:
    """A decode step of ``bs`` rows in working slots ``0..bs-1``, nothing tracked."""
    slots = torch.arange(bs, dtype=torch.int64, device=dev)
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int64, device=dev),
        mamba_cache_indices=slots,
        mamba_track_indices=torch.full_like(slots, -1),
        mamba_track_mask=torch.zeros_like(slots, dtype=torch.bool),
        has_mamba_track_mask=False,
    )


def replay_ms(rt: Runtime, bs: int, iters: int, position: int) -> dict[str, float]:
    """The captured decode step replayed alone: ``replay_ms``, GPU time per step of
    ``iters`` steps issued back to back (the host, faster than the GPU, keeps it busy);
    ``replay_isolated_ms``, the median GPU time between events around one step issued on an
    idle GPU (it includes the host's refresh before the graph launch); host time per step."""
    dev = rt.device
    replay = make_replay(rt, bs, position)
    for _ in range(3):
        replay()
    _sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            replay()
        return {"replay_ms": (time.perf_counter() - t0) / iters * 1e3}
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    for i in range(iters):
        t0 = time.perf_counter()
        starts[i].record()
        replay()
        ends[i].record()
        host.append(time.perf_counter() - t0)
        _sync(dev)
    gpu = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        replay()
    e1.record()
    _sync(dev)
    return {"replay_ms": e0.elapsed_time(e1) / iters, "replay_isolated_ms": statistics.median(gpu),
            "replay_isolated_min_ms": min(gpu), "replay_host_ms": statistics.median(host) * 1e3}  # fmt: skip


def profile_step(fn: Callable[[], Any], dev: torch.device, steps: int) -> dict[str, Any]:
    """Kernels per step and their summed GPU time (torch.profiler over ``steps`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync(dev)
    kernels = [
        e for e in prof.events()
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    ]  # fmt: skip
    names: dict[str, int] = {}
    times: dict[str, float] = {}
    for e in kernels:
        names[e.name] = names.get(e.name, 0) + 1
        times[e.name] = times.get(e.name, 0.0) + e.device_time
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    by_time = sorted(times.items(), key=lambda kv: -kv[1])[:25]
    total_us = sum(e.device_time for e in kernels) if kernels else 0.0
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_time_per_step_ms": total_us / steps / 1e3,
        "top_kernels": [
            {"name": n[:120], "per_step": c / steps, "us_per_step": times[n] / steps}
            for n, c in top
        ],
        # where the step's GPU time goes: the 25 kernels with the most time per step
        "top_kernels_by_time": [
            {"name": n[:120], "per_step": names[n] / steps, "us_per_step": t / steps}
            for n, t in by_time
        ],
    }


def hf_generate(hf: Any, vocab: int, bs: int, prompt_len: int, new: int, dev: torch.device) -> dict[str, Any]:
    """Decode tokens/s of ``generate`` (greedy, cache on): two runs differing only in the
    number of new tokens, so the prefill cancels out."""
    ids = torch.tensor([_prompt(prompt_len, vocab, 100 + b) for b in range(bs)], device=dev)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, use_cache=True)  # fmt: skip
        _sync(dev)
        return time.perf_counter() - t0

    run(2)  # warm-up
    t_short, t_long = run(1), run(new + 1)
    per_token = (t_long - t_short) / new
    return {"bs": bs, "prompt_len": prompt_len, "new_tokens": new, "seconds_1": t_short,
            f"seconds_{new + 1}": t_long, "decode_step_ms": per_token * 1e3,
            "decode_tokens_per_s": bs / per_token}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--dir", default="/dev/shm/hybridmeta-nano9b", help="checkpoint folder")
    ap.add_argument("--kernels", default="triton", choices=("triton", "reference"))
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--hf-new-tokens", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--small", action="store_true", help="tiny model on the CPU (script check)")
    args = ap.parse_args()
    with implementation(args.kernels):
        _main(args)


def _main(args: argparse.Namespace) -> None:
    dev = torch.device("cpu" if args.small else "cuda")
    cfg = tiny_config() if args.small else nano_config()
    prefill_len = 48 if args.small else args.prefill_len
    rows = 4 if args.small else 16
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "benchmark": "real_scale_decode",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke run)",
        "versions": {"hybridmeta": hybridmeta.__version__, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "config": cfg.to_hf_dict(),
        "kernels": args.kernels,
    }  # fmt: skip
    try:
        import transformers
        import triton

        res["versions"] |= {"transformers": transformers.__version__, "triton": triton.__version__}
    except ImportError:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        res["seconds"] = time.perf_counter() - t_start
        (out / f"real_scale_{args.tag}.json").write_text(json.dumps(res, indent=1))

    res["copy_ceiling"] = copy_ceiling(dev)
    print("copy ceiling", res["copy_ceiling"], flush=True)
    path = Path(args.dir)
    hf, res["build"] = build_and_save(cfg, path, dev)
    print("built and saved", res["build"], flush=True)
    t0 = time.perf_counter()
    model = load_nemotron_h(path, device=dev, dtype=torch.bfloat16)
    _sync(dev)
    res["build"]["load_s"] = time.perf_counter() - t0
    wb = weight_bytes(model)
    res["weights"] = {"bytes": wb, "params": sum(p.numel() for p in model.parameters()),
                      "read_floor_ms": wb / res["copy_ceiling"]["tbps"] / 1e9}  # fmt: skip
    print("loaded", res["build"], res["weights"], flush=True)
    save()

    t0 = time.perf_counter()
    rt = Runtime(model, RuntimeOptions(
        num_working=rows, num_track=rows, max_len=prefill_len + args.new_tokens + 8,
        track_interval=cfg.chunk_size, max_prefill_tokens=max(prefill_len, rows * 128),
        use_graphs=True, max_decode_bs=rows, use_prefix_cache=False,
    ))  # fmt: skip
    overlapped = rt.options
    _sync(dev)
    res["runtime_init_s"] = time.perf_counter() - t0  # includes capturing every bucket
    floor = res["weights"]["read_floor_ms"]
    # Warm-up requests of both measured shapes first (one prompt of the measured length,
    # then ``rows`` short ones): the prefill kernels' variants of each compile here, not
    # inside a timed step.
    t0 = time.perf_counter()
    run_requests(rt, [_prompt(prefill_len, cfg.vocab_size, 1)], 2)
    run_requests(rt, [_prompt(min(128, prefill_len), cfg.vocab_size, 500 + b)
                      for b in range(rows)], 2)  # fmt: skip
    res["warmup_request_s"] = time.perf_counter() - t0
    steps: dict[str, Any] = {}
    for bs in (1, rows):
        plen = prefill_len if bs == 1 else min(128, prefill_len)
        # decode steps overlapped (the runtime's default: each step's host work runs while
        # the previous step's forward runs), then the same requests with every step waiting
        # for its own tokens
        before = rt.overlapped_steps
        r = run_requests(rt, [_prompt(plen, cfg.vocab_size, 10 + b) for b in range(bs)],
                         args.new_tokens)  # fmt: skip
        r["overlapped_steps"] = rt.overlapped_steps - before
        rt.options = attrs.evolve(overlapped, overlap_decode=False)
        sync = run_requests(rt, [_prompt(plen, cfg.vocab_size, 10 + b) for b in range(bs)],
                            args.new_tokens)  # fmt: skip
        r["synchronous"] = {k: v for k, v in sync.items() if k != "prefill_steps"}
        # the same requests again, timing the host pieces of each step (median us), once
        # each way; the figures above come from the runs without the timers
        for name, opts in (("host_us_median_sync", rt.options), ("host_us_median", overlapped)):
            rt.options = opts
            with host_breakdown(rt) as times:
                run_requests(rt, [_prompt(plen, cfg.vocab_size, 10 + b) for b in range(bs)],
                             args.new_tokens)  # fmt: skip
            r[name] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            print(name, {k: round(v, 1) for k, v in r[name].items()})
        # replayed at the decode steps' own context (the prompt's length), and at position
        # 3 (attention over 4 keys: the step without its context)
        ctx = plen + args.new_tokens // 2
        r |= replay_ms(rt, bs, 20, ctx)
        r["replay_position"] = ctx
        r["replay_pos3_ms"] = replay_ms(rt, bs, 20, 3)["replay_ms"]
        assert rt.graphs is not None
        r["graph_profile"] = profile_step(make_replay(rt, bs, ctx), dev, 3)
        r["step_floor"] = step_floor(rt.pool, bs, ctx, wb, res["copy_ceiling"]["tbps"])
        sfloor = r["step_floor"]["floor_ms"]
        if "decode_step_wall_ms" in r:
            r["wall_over_floor"] = r["decode_step_wall_ms"] / floor
            r["wall_over_step_floor"] = r["decode_step_wall_ms"] / sfloor
        if "decode_step_wall_ms" in r["synchronous"]:
            r["synchronous"]["wall_over_floor"] = r["synchronous"]["decode_step_wall_ms"] / floor
        r["replay_over_floor"] = r["replay_ms"] / floor
        r["replay_over_step_floor"] = r["replay_ms"] / sfloor
        steps[f"bs{bs}"] = r
        for k in r["graph_profile"]["top_kernels_by_time"][:15]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['per_step']:5.1f}  {k['name'][:90]}")
        print(f"bs {bs}", {k: v for k, v in r.items() if k != "graph_profile"},
              {k: v for k, v in r["graph_profile"].items() if not k.startswith("top_kernels")}, flush=True)
        save()
    res["runtime"] = steps

    # Kernels of one eager decode step (no graph): what the graph replays, counted directly.
    md = prepare_decode(_decode_forward(rows, dev))
    ids = torch.full((rows,), 5, dtype=torch.int64, device=dev)
    pos = torch.full((rows,), 3, dtype=torch.int64, device=dev)
    pool = rt.pool

    def eager_step() -> torch.Tensor:
        with torch.no_grad():
            return model.forward_decode(ids, pos, md, pool)

    res["eager_step_profile"] = profile_step(eager_step, dev, 2)
    print("eager step", {k: v for k, v in res["eager_step_profile"].items() if not k.startswith("top_kernels")},
          flush=True)  # fmt: skip
    save()
    del rt
    gc.collect()

    if not args.no_hf:
        hf_res = []
        for bs in (1, rows):
            try:
                hf_res.append(hf_generate(hf, cfg.vocab_size, bs, 128 if not args.small else 16,
                                          args.hf_new_tokens, dev))  # fmt: skip
            except Exception as e:  # the comparison is optional: keep the rest
                hf_res.append({"bs": bs, "error": repr(e)[:500]})
            print("transformers generate", hf_res[-1], flush=True)
            save()
        res["transformers_generate"] = hf_res
        for r in hf_res:
            ours = steps.get(f"bs{r['bs']}", {}).get("decode_tokens_per_s")
            if "decode_tokens_per_s" in r and ours:
                r["ours_over_transformers"] = ours / r["decode_tokens_per_s"]
    save()
    shutil.rmtree(path, ignore_errors=True)
    print(f"wrote {out / f'real_scale_{args.tag}.json'} in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
