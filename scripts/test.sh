#!/usr/bin/env bash
# The default test run, under the Khronos validation layer: any validation message fails it.
# Slow tests (long fuzzing, soak) are separate: scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
export VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation
.venv/bin/python -m ruff check vkgraph tests benchmarks examples scripts
exec .venv/bin/python -m pytest -q "$@"
