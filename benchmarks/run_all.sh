#!/usr/bin/env bash
# Every benchmark on a real GPU, each log into OUTDIR; then the default test suite with its slowest tests.
#   bash benchmarks/run_all.sh OUTDIR [--quick]
# --quick skips the LLM benchmark (it builds an 8B-shaped model) and the validation-layer test run.
set -uo pipefail
out=${1:?usage: run_all.sh OUTDIR [--quick]}
quick=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-900}" "$@" 2>&1 | tee "$out/$name.log"; }
run tests python3 -m pytest -q -p no:cacheprovider tests --durations=25
run runtime python3 benchmarks/bench_runtime.py --json "$out/runtime.json"
run jit python3 benchmarks/bench_jit.py --steps 30
run kernels python3 benchmarks/bench_kernels.py
run tensor python3 benchmarks/bench_tensor.py --gpu
if [ "$quick" != "--quick" ]; then
  run llm python3 benchmarks/bench_llm.py
  VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation run tests_validation \
    python3 -m pytest -q -p no:cacheprovider tests --durations=25
fi
