#!/usr/bin/env bash
# The GPU run (device tool), in parts: the CUDA capture-refusal table, the GPU-marked tests
# of every part, compute-sanitizer over the kernels' GPU tests, the main job on CUDA, the
# kernel/spec/prefill/graph benchmarks (peers side by side when the bundle is there), and
# the real-scale decode benchmark.
#
# Usage (repository root, on the GPU machine):
#   OUT=/some/dir [HYBRIDMETA_PEERS=bundle] bash scripts/gpu_suite.sh [parts...]
# parts: refusals tests sanitizer job bench realscale (default: all); spec (only the
# speculative-decoding GPU tests and the main job: `tests` and `job` include them). Logs and JSON land in
# $OUT (flat: the device tool brings back files two folders down at most).
set -uo pipefail
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
parts=${*:-refusals tests sanitizer job bench realscale}
step() { echo "=== $(date -u +%H:%M:%S) $*"; }

step env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$OUT/env.txt"

for p in $parts; do case $p in
refusals)
  step "what a real CUDA capture refuses (tests/graphs/cuda_capture_refusals.json)"
  python3 scripts/cuda_capture_refusals.py --out "$OUT/cuda_capture_refusals.json" > "$OUT/refusals.log" 2>&1
  cp "$OUT/cuda_capture_refusals.json" tests/graphs/cuda_capture_refusals.json
  grep -c REFUSED "$OUT/refusals.log"
  ;;
tests)
  step "gpu tests: properties and graphs thorough, the rest ci"
  HYPOTHESIS_PROFILE=thorough timeout ${THOROUGH_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
    tests/properties tests/graphs 2>&1 | tee "$OUT/gpu_tests_thorough.log" | tail -6
  HYPOTHESIS_PROFILE=ci timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
    tests/kernels tests/runtime tests/examples tests/test_*.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  ;;
sanitizer)
  step "compute-sanitizer memcheck over the kernels' GPU tests"
  HYPOTHESIS_PROFILE=ci timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool memcheck --target-processes all \
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels -k "not int32_offsets and not long_context" 2>&1 \
    | tee "$OUT/sanitizer.log" | tail -4
  ;;
spec)
  step "spec decode: (B, T) verify + commit replay machine on CUDA graphs, runtime spec decode (thorough)"
  HYPOTHESIS_PROFILE=thorough timeout ${SPEC_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 \
    tests/properties/test_graphs_spec_replay.py tests/runtime/test_spec.py \
    2>&1 | tee "$OUT/gpu_spec.log" | tail -15
  step "main job on CUDA (spec decode row included)"
  timeout 180 python3 -m hybridmeta.cli --device cuda 2>&1 | tee "$OUT/main_job_cuda.log" | tail -30
  ;;
job)
  step "main job on CUDA"
  timeout 180 python3 -m hybridmeta.cli --device cuda 2>&1 | tee "$OUT/main_job_cuda.log" | tail -16
  ;;
bench)
  step "benchmarks"
  timeout 240 python3 benchmarks/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/bench_kernels.log" | tail -12
  timeout 120 python3 benchmarks/bench_spec.py --out "$OUT" --no-sweep 2>&1 | tee "$OUT/bench_spec.log" | tail -6
  timeout 90 python3 benchmarks/bench_prefill.py --out "$OUT" 2>&1 | tee "$OUT/bench_prefill.log" | tail -4
  timeout 60 python3 benchmarks/bench_graphs.py --out "$OUT" 2>&1 | tee "$OUT/bench_graphs.log" | tail -6
  timeout 90 python3 benchmarks/bench_attention.py --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" | tail -12
  timeout 180 python3 benchmarks/bench_gemv.py --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/bench_gemv.log" | tail -24
  timeout 60 python3 benchmarks/bench_host.py --out "$OUT" 2>&1 | tee "$OUT/bench_host.log" | tail -8
  ;;
realscale)
  step "real-scale decode (Nemotron-Nano-9B-v2 architecture, random weights)"
  timeout ${REALSCALE_TIMEOUT:-300} python3 benchmarks/bench_real_scale.py --out "$OUT" 2>&1 | tee "$OUT/real_scale.log" | tail -12
  ;;
esac; done
step done
