#!/usr/bin/env bash
# The GPU tests, on a GPU machine from the repository root, after the set-up of docs/testing.md (wheels carried in
# .gpu-wheels/, FlashInfer's kernels in .fi-cache/):
#   bash tests/gpu/run.sh [pytest arguments]      (default: all of tests/gpu)
# The set-up (scripts/gpu_env.sh) also makes the random-weight checkpoint the tests load. The log is $OUT/tests.log.
set -u
. scripts/gpu_env.sh
need_checkpoint "$MINISRV_GPU_CKPT" qwen3-0.6b
background 3600 python3 -X faulthandler -m pytest -q -rs -o faulthandler_timeout=300 "${@:-tests/gpu}" \
  > "$OUT/tests.log" 2>&1
wait "$BG_PID"; rc=$?
grep -v -E "Warning|warn\(" "$OUT/tests.log" | tail -n 60
save_fi_cache
exit $rc
