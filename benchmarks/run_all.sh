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
run tune_matvec python3 benchmarks/tune_matvec.py
if [ "$quick" != "--quick" ]; then
  # the same GGUF files for vkgraph and llama.cpp (when cyllama-vulkan is installed): random blocks, in seconds
  python3 scripts/make_tiny_model.py "$out/m8b" --preset llama3-8b --gguf Q4_0,Q8_0 --random-quants > /dev/null
  run llm python3 benchmarks/bench_llm.py --gguf "$out/m8b/model-q4_0.gguf" --gguf "$out/m8b/model-q8_0.gguf"
  # the same with float activations in the quantized matvecs (no integer dot products), vkgraph alone
  VKGRAPH_INT_DOT=0 run llm_float python3 benchmarks/bench_llm.py --no-peers \
    --gguf "$out/m8b/model-q4_0.gguf" --gguf "$out/m8b/model-q8_0.gguf"
  rm -rf "$out/m8b"
  run profile python3 benchmarks/profile_decode.py --format Q4_0
  VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation run tests_validation \
    python3 -m pytest -q -p no:cacheprovider tests --durations=25
fi
