#!/usr/bin/env bash
# The whole GPU run in one call (device tool): GPU-marked tests of every part, the
# benchmarks, compute-sanitizer over the kernel suite, and the main job on CUDA.
# Usage (repository root, on the GPU machine): OUT=/some/dir bash scripts/gpu_suite.sh [parts...]
# parts: tests bench sanitizer job (default: all), spec (only the speculative-decoding gpu
# tests and the main job, for a short run; `tests` and `job` include them). Logs and JSON
# land in $OUT/run/, packed into $OUT/gpu_run.tar.gz at the end.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
R=$OUT/run
mkdir -p "$R"
parts=${*:-tests bench sanitizer job}
step() { echo "=== $(date -u +%H:%M:%S) $*"; }

step env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$R/env.txt"

for p in $parts; do case $p in
tests)
  step "gpu tests (thorough profile)"
  HYPOTHESIS_PROFILE=thorough timeout ${TESTS_TIMEOUT:-270} python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels tests/graphs tests/prefill tests/runtime tests/properties \
    --junitxml="$R/gpu_tests.xml" 2>&1 | tee "$R/gpu_tests.log" | tail -25
  ;;
bench)
  step "benchmarks"
  timeout 240 python3 benchmarks/bench_kernels.py --out "$R" 2>&1 | tee "$R/bench_kernels.log" | tail -40
  timeout 60 python3 benchmarks/bench_graphs.py --out "$R" 2>&1 | tee "$R/bench_graphs.log" | tail -15
  timeout 90 python3 benchmarks/bench_prefill.py --out "$R" 2>&1 | tee "$R/bench_prefill.log" | tail -15
  timeout 60 python3 benchmarks/bench_metadata.py --out "$R" 2>&1 | tee "$R/bench_metadata.log" | tail -3
  ;;
sanitizer)
  step "compute-sanitizer memcheck over the kernel suite"
  HYPOTHESIS_PROFILE=ci timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool memcheck --target-processes all \
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$R/sanitizer.log" | tail -8
  ;;
spec)
  step "spec decode: (B, T) verify + commit replay machine on CUDA graphs, runtime spec decode (thorough)"
  HYPOTHESIS_PROFILE=thorough timeout ${SPEC_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/properties/test_graphs_spec_replay.py tests/runtime/test_spec.py \
    --junitxml="$R/gpu_spec.xml" 2>&1 | tee "$R/gpu_spec.log" | tail -15
  step "main job on CUDA (spec decode row included)"
  timeout 180 python3 -m hybridmeta.cli --device cuda 2>&1 | tee "$R/main_job_cuda.log" | tail -30
  ;;
job)
  step "main job on CUDA"
  timeout 180 python3 -m hybridmeta.cli --device cuda 2>&1 | tee "$R/main_job_cuda.log" | tail -30
  ;;
esac; done
step done
tar -C "$OUT" -czf "$OUT/gpu_run.tar.gz" run && rm -rf "$R"
