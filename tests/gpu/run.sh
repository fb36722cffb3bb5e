#!/usr/bin/env bash
# GPU tests and benchmarks in one script, run from the repo root of a GPU machine. It expects the wheel bundles
# in .gpu-wheels/ (fa3, fi, srv, tools: FlashAttention-3, FlashInfer, server packages, install and checkpoint
# scripts) and makes a random-weight Qwen3-0.6B-shaped checkpoint at $MINISRV_GPU_CKPT (default /tmp/qwen3).
#   bash tests/gpu/run.sh [phase ...]
#   phases: smoke e2e graph overlap sampling grammar backends fp8kv bench bench-steps bench-profile bench-p1 bench-fi
#           bench-fa bench-fp8kv bench-nocache bench-shared bench-shared-lpm bench-shared-off decode profile cprofile
#           llama8b
# Logs go to $OUT (or ./gpu-out); FlashInfer's compiled kernels are copied there too, to carry next time
# (.fi-cache/ is restored into FlashInfer's cache before anything runs).
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$(bash .gpu-wheels/tools/install_on_device.sh 2>/dev/null):$PWD
export MINISRV_GPU_CKPT=${MINISRV_GPU_CKPT:-/tmp/qwen3}
FI_CACHE=$HOME/.cache/flashinfer/0.6.13/90a/cached_ops
# FlashInfer re-runs ninja for anything in its JIT dir (and rebuilds without the object files), but loads a module
# found in its AOT dir (<package>/data/aot/<name>/<name>.so) as is: put the carried kernels there
[ -d .fi-cache-min ] && [ ! -d .fi-cache ] && mv .fi-cache-min .fi-cache  # a subset carried when the whole is too big
if [ -d .fi-cache ]; then
  FI_AOT=$(python3 -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("flashinfer").origin), "data", "aot"))')
  for f in .fi-cache/*.so; do [ -e "$f" ] || continue
    name=$(basename "$f" .so); mkdir -p "$FI_AOT/$name"; cp -n "$f" "$FI_AOT/$name/$name.so"; done
fi
[ -f "$MINISRV_GPU_CKPT/config.json" ] || python3 .gpu-wheels/tools/make_checkpoint.py "$MINISRV_GPU_CKPT" qwen3-0.6b >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; local t=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/run.log" | grep -v -E "Warning|warn\(" | tail -n 40
  echo "=== $name done in $((SECONDS - t))s (rc ${PIPESTATUS[0]})"; save_cache; }
# carry newly compiled FlashInfer kernels back after every step (at most 8 files come back from a call: 3 logs
# and 5 kernels; a kernel already in .fi-cache is not sent again)
save_cache() { ls -S "$FI_CACHE"/*/*.so 2>/dev/null | while read -r f; do
    [ -e ".fi-cache/$(basename "$f")" ] || echo "$f"; done | head -5 | while read -r f; do cp -u "$f" "$OUT/"; done; }
BENCH="python3 scripts/bench_offline.py --model $MINISRV_GPU_CKPT --json $OUT/bench.jsonl"
for phase in "${@:-smoke}"; do
  case $phase in
    smoke) step smoke 300 python3 scripts/generate.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
             --max-tokens 8 --log-level info "w1 w2 w3" "w5 w6" ;;
    e2e) step e2e 500 python3 -m pytest -q -s tests/gpu/test_e2e.py ;;
    graph) step graph 400 python3 -m pytest -q -s tests/gpu/test_cuda_graph.py ;;
    # FlashInfer compiles one kernel set per (dtype, head_dim, decode kind), minutes each: build them in parallel,
    # one pytest per head configuration, then run the whole file once more for the report
    backends) for c in 32-8-128-bf16 32-8-128-fp16 16-8-128-bf16 8-1-64-bf16 16-2-64-fp16; do
                (timeout 400 python3 -m pytest -q -x tests/gpu/test_backends.py -k "$c" >/tmp/warm-$c.log 2>&1;
                 echo "warm $c: $(tail -n 1 /tmp/warm-$c.log)") & done; wait
              step backends 300 python3 -m pytest -q -rs tests/gpu/test_backends.py ;;
    # the FP8 KV cache: backends on an FP8 pool against torch, graph replays, end to end against HF (FlashInfer's
    # FP8-KV kernels are builds of their own: made in parallel first, as for backends)
    fp8kv) for c in 32-8-128-bf16 16-8-128-bf16 16-2-64-fp16; do
             (timeout 400 python3 -m pytest -q -x tests/gpu/test_fp8_kv.py -k "$c" >/tmp/warm-fp8-$c.log 2>&1;
              echo "warm $c: $(tail -n 1 /tmp/warm-fp8-$c.log)") & done; wait
           step fp8kv 500 python3 -m pytest -q -s -rs tests/gpu/test_fp8_kv.py ;;
    sampling) step sampling 300 python3 -m pytest -q tests/gpu/test_sampling.py ;;
    grammar) step grammar 300 python3 -m pytest -q -s tests/gpu/test_grammar.py ;;
    overlap) step overlap 400 python3 -m pytest -q -s tests/gpu/test_overlap.py ;;
    bench) step bench 300 $BENCH --attention-backend auto ;;
    bench-profile) step bench-profile 300 $BENCH --attention-backend auto --profile ;;  # syncs every phase: no overlap
    bench-p1) step bench-p1 300 $BENCH --attention-backend auto --page-size 1 ;;
    bench-fi) step bench-fi 300 $BENCH --attention-backend fi ;;
    bench-fa) step bench-fa 300 $BENCH --attention-backend fa ;;
    bench-fp8kv) step bench-fp8kv 300 $BENCH --attention-backend auto --workload nano --kv-cache-dtype fp8_e4m3 ;;
    bench-nocache) step bench-nocache 300 $BENCH --attention-backend auto --disable-radix-cache ;;
    bench-prefix) step bench-prefix 300 $BENCH --attention-backend auto --workload prefix ;;
    bench-prefix-off) step bench-prefix-off 300 $BENCH --attention-backend auto --workload prefix --disable-radix-cache ;;
    bench-prefix-512) step bench-prefix-512 300 $BENCH --attention-backend auto --workload prefix --max-output-len 512 ;;
    bench-prefix-512-off) step bench-prefix-512-off 300 $BENCH --attention-backend auto --workload prefix --max-output-len 512 --disable-radix-cache ;;
    bench-shared) step bench-shared 300 $BENCH --attention-backend auto --workload shared ;;
    bench-shared-lpm) step bench-shared-lpm 300 $BENCH --attention-backend auto --workload shared --schedule-policy lpm ;;
    bench-shared-off) step bench-shared-off 300 $BENCH --attention-backend auto --workload shared --disable-radix-cache ;;
    profile) step profile 200 python3 scripts/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
               --batch-sizes 1,64,256 --graphs on --steps 16 --torch-profile ;;
    cprofile) step cprofile 200 python3 scripts/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
               --batch-sizes 1,64 --graphs on --steps 32 --cprofile ;;
    bench-steps) step bench-steps 300 $BENCH --attention-backend auto --steps ;;
    decode) step decode 300 python3 scripts/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
              --batch-sizes 1,64,256 --json "$OUT/decode.jsonl" ;;
    llama8b) [ -f /tmp/llama8b/config.json ] || python3 .gpu-wheels/tools/make_checkpoint.py /tmp/llama8b llama3-8b >/dev/null 2>&1
             step llama8b 400 python3 scripts/bench_offline.py --model /tmp/llama8b --num-prompts 64 --json "$OUT/bench.jsonl" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
ls -la "$OUT" | tail -n +2
