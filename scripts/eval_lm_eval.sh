#!/usr/bin/env bash
# Scores a multiple-choice task with lm-evaluation-harness against a running minisrv server, with no hub access:
# the task's data is a local file (scripts/lm_eval/), and the tokenizer is the server's own (/tokenizer_info,
# /tokenize, /detokenize: lm-eval's `tokenizer_backend=remote`). Each choice is scored as a completions request with
# echo, logprobs and max_tokens 0 (the prompt's logprobs).
#   python -m minisrv.launch_server &          # the default model on 127.0.0.1:30000
#   pip install "lm-eval[api]"                 # not a dependency of minisrv or of its tests
#   bash scripts/eval_lm_eval.sh [base_url]
set -euo pipefail
BASE=${1:-http://127.0.0.1:30000}
LM_EVAL=${LM_EVAL:-lm_eval}
MODEL=$(curl -s "$BASE/v1/models" | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
cd "$(dirname "$0")/lm_eval"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$LM_EVAL" --model local-completions \
  --model_args "base_url=$BASE/v1/completions,model=$MODEL,tokenizer_backend=remote,num_concurrent=4,max_retries=1" \
  --include_path . --tasks minisrv_capitals --batch_size 1
