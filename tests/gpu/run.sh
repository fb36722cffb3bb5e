#!/usr/bin/env bash
# GPU tests and benchmarks in one script, run from the repo root of a GPU machine. It expects the wheel bundles
# in .gpu-wheels/ (fa3, fi, srv, tools: FlashAttention-3, FlashInfer, server packages, install and checkpoint
# scripts) and makes a random-weight Qwen3-0.6B-shaped checkpoint at $MINISRV_GPU_CKPT (default /tmp/qwen3).
#   bash tests/gpu/run.sh [phase ...]
#   phases: smoke e2e graph overlap sampling grammar backends cascade fp8kv bench bench-steps bench-profile bench-p1
#           bench-fi bench-fa bench-fp8kv bench-nocache bench-prefix bench-prefix-off bench-prefix-cascade
#           bench-prefix-512 bench-prefix-512-off bench-prefix-512-cascade bench-shared
#           bench-shared-off bench-shared-cascade bench-grammar bench-grammar-cprofile bench-fa-fp8kv bench-fp8kv-xqa decode-fp8w-fa
#           gemm-e2e llama8b-fp8-fa serving serving-grammar decode profile cprofile llama8b
#           attn attn-small gemm-fp8 tp tp-decode tp-decode-fa tp-offline decode-profile tp-profile tp-cprofile comm-build tp-fused tp-fp8 fp8w llama8b-fp8 decode-fp8 decode-fp8w profile-fp8
#           llama8b-fp8-xqa decode-fp8w-xqa half-profile
#           allreduce-fused tp-profile-fused half-offline startup startup-fresh startup-8b imports moe moe-kernel moe-bench
#           moe-align moe-decode moe-decode-fa moe-profile moe-sweep moe-offline moe-steps moe-fp8 serving-think startup-fi layer-kernels peer-moe
#           triton-tests attn-triton attn-triton-tune moe-decode-triton decode-triton bench-triton bench-ab moe-offline-ab
# Logs go to $OUT (or ./gpu-out); FlashInfer's compiled kernels are copied there too, to carry next time
# (.fi-cache/ is restored into FlashInfer's cache before anything runs).
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
# a call cut off by its time limit leaves its step running (timeout stops only this script): stop what an earlier
# run left, so that it holds neither GPU memory nor FlashInfer's build locks
pkill -f "^[^ ]*python[0-9.]* .*(pytest|scripts/bench_|multiprocessing.spawn|get_trtllm_comm_module)" 2>/dev/null && sleep 3
export PYTHONPATH=$(bash .gpu-wheels/tools/install_on_device.sh 2>/dev/null):$PWD
export MINISRV_GPU_CKPT=${MINISRV_GPU_CKPT:-/tmp/qwen3}
FI_CACHE=$HOME/.cache/flashinfer/0.6.13/90a/cached_ops
# FlashInfer re-runs ninja for anything in its JIT dir (and rebuilds without the object files), but loads a module
# found in its AOT dir (<package>/data/aot/<name>/<name>.so) as is: put the carried kernels there
# subsets carried when the whole is too big: .fi-cache-min (one GPU, FP8 included), .fi-cache-tp (bf16 Llama-8B and
# the all-reduce fusion's trtllm_comm, for the two-GPU runs)
for sub in .fi-cache-min .fi-cache-tp; do
  [ -d $sub ] && mkdir -p .fi-cache && cp -n $sub/*.so .fi-cache/ 2>/dev/null; done
if [ -d .fi-cache ]; then
  FI_AOT=$(python3 -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("flashinfer").origin), "data", "aot"))')
  for f in .fi-cache/*.so; do [ -e "$f" ] || continue
    name=$(basename "$f" .so); mkdir -p "$FI_AOT/$name"; cp -n "$f" "$FI_AOT/$name/$name.so"; done
fi
[ -f "$MINISRV_GPU_CKPT/config.json" ] || python3 .gpu-wheels/tools/make_checkpoint.py "$MINISRV_GPU_CKPT" qwen3-0.6b >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step() { local name=$1$TAG limit=$2; shift 2; echo "=== $name"; local t=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/run.log" | grep -v -E "Warning|warn\(" | tail -n 40
  echo "=== $name done in $((SECONDS - t))s (rc ${PIPESTATUS[0]})"; save_cache; }
# carry newly compiled FlashInfer kernels back after every step (at most 8 files come back from a call: 3 logs
# and 5 kernels; a kernel already in .fi-cache is not sent again)
save_cache() { ls -S "$FI_CACHE"/*/*.so 2>/dev/null | while read -r f; do
    [ -e ".fi-cache/$(basename "$f")" ] || echo "$f"; done | head -5 | while read -r f; do cp -u "$f" "$OUT/"; done; }
# FlashInfer's communication kernels (--enable-flashinfer-allreduce-fusion): a JIT build of minutes. comm-build starts it in the background so that other phases run meanwhile; the tp phases wait for it
# (FlashInfer 0.6.13's flashinfer.comm imports cuda.tile: the fi bundle needs the cuda_tile wheel for cp312, e.g.
# pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 cuda_tile)
COMM_PID=
wait_comm() { [ -n "$COMM_PID" ] && wait "$COMM_PID"; COMM_PID=; tail -n 1 /tmp/comm-build.log 2>/dev/null; }
# bench_serving against a server on the checkpoint, started in the background and stopped (SIGTERM) after it;
# 256 requests of 256-512 prompt and 128-256 output tokens at 64 req/s. Its results and the server's log stay in
# /tmp (the table is in run.log), so that no more files come back than the call allows.
# the checkpoint maker's word-level tokenizer cannot write JSON: the structured-output runs use one that can
JTOK=/tmp/json-tokenizer
# the Llama-3-8B-shaped random checkpoint of the 8B phases, made once per machine
need_llama8b() { [ -f /tmp/llama8b/config.json ] || python3 .gpu-wheels/tools/make_checkpoint.py /tmp/llama8b llama3-8b >/dev/null 2>&1; }
# one tp 2 rank's share of that shape on one GPU (half the heads, half the MLP width; the whole vocabulary, so its
# lm_head is twice a rank's): a tp 2 rank's step less its all-reduces, where two GPUs are not to be had
need_llama8b_half() { [ -f /tmp/llama8b-half/config.json ] || { sed -e 's/intermediate_size=14336/intermediate_size=7168/' \
    -e 's/num_attention_heads=32, num_key_value_heads=8,/num_attention_heads=16, num_key_value_heads=4,/' \
    .gpu-wheels/tools/make_checkpoint.py > /tmp/make_half_checkpoint.py
  python3 /tmp/make_half_checkpoint.py /tmp/llama8b-half llama3-8b >/dev/null 2>&1; }; }
# Qwen3-30B-A3B's shape with 24 of its 48 layers (30 GB, about 65 s to write), made once per machine
need_moe() { [ -f /tmp/moe/config.json ] || python3 .gpu-wheels/tools/make_checkpoint.py /tmp/moe qwen3-30b-a3b-half >/dev/null 2>&1; }
json_tokenizer() { [ -f $JTOK/tokenizer.json ] || python3 tests/gpu/json_tokenizer.py $JTOK "$MINISRV_GPU_CKPT" >/dev/null; }
serving() { local name=$1; shift; local port=30123 log=/tmp/$name-server.log pid
  PYTHONPATH=$PWD/$R:$PYTHONPATH python3 -P -m minisrv.launch_server --model "$MINISRV_GPU_CKPT" --attention-backend auto --port $port ${SERVER_ARGS:-} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break; sleep 1; done
  step "$name" 240 python3 $S/bench_serving.py --base-url http://127.0.0.1:$port --num-prompts 256 \
    --request-rate 64 --random-input-len 512 --random-output-len 256 --random-range-ratio 0.5 \
    --output /tmp/$name.json "$@"
  kill $pid 2>/dev/null; wait $pid; echo "server exited rc $? (log: $log)"; tail -n 3 "$log"; }
# the nano workload's lengths through a server's chat endpoint (the reasoning-parser cost)
serving_nano() { local name=$1; local port=30124 log=/tmp/$1-server.log pid
  PYTHONPATH=$PWD/$R:$PYTHONPATH python3 -P -m minisrv.launch_server --model "$MINISRV_GPU_CKPT" --attention-backend auto --port $port ${SERVER_ARGS:-} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || break; sleep 1; done
  grep -i "reasoning" "$log" | tail -n 1
  step "$name" 240 python3 $S/bench_serving.py --base-url http://127.0.0.1:$port --endpoint chat --num-prompts 256 \
    --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.0977 --temperature 0.6 \
    --output /tmp/$name.json
  kill $pid 2>/dev/null; wait $pid; }
# PHASE@base runs PHASE's benchmark scripts and servers from .baseline/ (an earlier tree of the project, carried beside this one),
# so that a change and what it replaced are measured in one lease
for phase in "${@:-smoke}"; do
  S=scripts TAG= R=.
  case $phase in *@base) S=.baseline/scripts TAG=@base R=.baseline phase=${phase%@base} ;; esac
  BENCH="python3 $S/bench_offline.py --model $MINISRV_GPU_CKPT --json $OUT/bench.jsonl"
  case $phase in
    smoke) step smoke 300 python3 scripts/generate.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
             --max-tokens 8 --log-level info "w1 w2 w3" "w5 w6" ;;
    layer-kernels) step layer-kernels 300 python3 -m pytest -q -s tests/gpu/test_fused_layer_kernels.py ;;
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
    fp8w) step fp8w 400 python3 -m pytest -q -s -rs tests/gpu/test_fp8_weights.py ;;
    # the small-batch FP8 GEMM's tests alone: the kernel and every launch rule on Llama-3-8B's shapes against _scaled_mm
    gemm-e2e) step gemm-e2e 300 python3 -m pytest -q -s -rs tests/gpu/test_fp8_weights.py -k "small_batch or launch_rule" ;;
    sampling) step sampling 300 python3 -m pytest -q tests/gpu/test_sampling.py ;;
    grammar) step grammar 300 python3 -m pytest -q -s tests/gpu/test_grammar.py tests/gpu/test_thinking.py ;;
    overlap) step overlap 400 python3 -m pytest -q -s tests/gpu/test_overlap.py ;;
    cascade) step cascade 500 python3 -m pytest -q -s -rs tests/gpu/test_cascade.py ;;
    bench) step bench 300 $BENCH --attention-backend auto ;;
    bench-profile) step bench-profile 300 $BENCH --attention-backend auto --profile ;;  # syncs every phase: no overlap
    bench-p1) step bench-p1 300 $BENCH --attention-backend auto --page-size 1 ;;
    bench-fi) step bench-fi 300 $BENCH --attention-backend fi ;;
    bench-fa) step bench-fa 300 $BENCH --attention-backend fa ;;
    bench-fp8kv) step bench-fp8kv 300 $BENCH --attention-backend auto --workload nano --kv-cache-dtype fp8_e4m3 ;;
    bench-nocache) step bench-nocache 300 $BENCH --attention-backend auto --disable-radix-cache ;;
    bench-prefix) step bench-prefix 300 $BENCH --attention-backend auto --workload prefix ;;
    bench-prefix-cascade) step bench-prefix-cascade 300 $BENCH --attention-backend auto --workload prefix --enable-cascade-attention ;;
    bench-prefix-off) step bench-prefix-off 300 $BENCH --attention-backend auto --workload prefix --disable-radix-cache ;;
    bench-prefix-512) step bench-prefix-512 300 $BENCH --attention-backend auto --workload prefix --max-output-len 512 ;;
    bench-prefix-512-cascade) step bench-prefix-512-cascade 300 $BENCH --attention-backend auto --workload prefix --max-output-len 512 --enable-cascade-attention ;;
    bench-prefix-512-off) step bench-prefix-512-off 300 $BENCH --attention-backend auto --workload prefix --max-output-len 512 --disable-radix-cache ;;
    bench-shared) step bench-shared 300 $BENCH --attention-backend auto --workload shared ;;
    bench-shared-off) step bench-shared-off 300 $BENCH --attention-backend auto --workload shared --disable-radix-cache ;;
    bench-shared-cascade) step bench-shared-cascade 300 $BENCH --attention-backend auto --workload shared --enable-cascade-attention ;;
    # every request constrained, then the same unconstrained (prefix cache off: the second run must not find the
    # first one's prompts cached)
    bench-grammar) json_tokenizer; step bench-grammar 300 $BENCH --attention-backend auto --json-schema --tokenizer $JTOK \
                     --disable-radix-cache ;;
    bench-grammar-cprofile) json_tokenizer; step bench-grammar-cprofile 300 $BENCH --attention-backend auto --json-schema \
                     --tokenizer $JTOK --disable-radix-cache --cprofile ;;
    bench-fp8kv-xqa) step bench-fp8kv-xqa 300 $BENCH --attention-backend auto --workload nano --kv-cache-dtype fp8_e4m3 \
                       --fp8-decode-kernel xqa ;;
    llama8b-fp8-xqa) need_llama8b
             step llama8b-fp8-xqa 400 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 \
               --quantization fp8 --kv-cache-dtype fp8_e4m3 --fp8-decode-kernel xqa --json "$OUT/bench.jsonl" ;;
    decode-fp8w-xqa) need_llama8b; step decode-8b-fp8w-xqa 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                 --batch-sizes 1,64,256 --graphs on --steps 32 --quantization fp8 --kv-cache-dtype fp8_e4m3 \
                 --fp8-decode-kernel xqa --json "$OUT/decode.jsonl" ;;
    bench-fa-fp8kv) step bench-fa-fp8kv 300 $BENCH --attention-backend fa --workload nano --kv-cache-dtype fp8_e4m3 ;;
    decode-fp8w-fa) need_llama8b; step decode-8b-fp8w-fa 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend fa \
                 --batch-sizes 1,64,256 --graphs on --steps 32 --quantization fp8 --kv-cache-dtype fp8_e4m3 \
                 --json "$OUT/decode.jsonl" ;;
    llama8b-fp8-fa) need_llama8b; step llama8b-fp8-fa 400 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 \
               --attention-backend fa --quantization fp8 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench.jsonl" ;;
    serving) serving serving ;;
    # the reasoning parser's cost: the nano workload's lengths (100-1,024 prompt and output tokens) through the chat
    # endpoint, 256 requests at once, parser off / on four times (deepseek_r1: every output is thinking until a
    # `</think>`, so each streamed piece goes through the split)
    serving-think) [ -f /tmp/think-tok/tokenizer.json ] || python3 tests/gpu/think_tokenizer.py /tmp/think-tok "$MINISRV_GPU_CKPT"
                   for parser in "" "--reasoning-parser deepseek_r1" "" "--reasoning-parser deepseek_r1" "" "--reasoning-parser deepseek_r1" \
                                 "" "--reasoning-parser deepseek_r1"; do
                     SERVER_ARGS="--tokenizer /tmp/think-tok $parser" serving_nano "serving-think${parser:+-on}"; done ;;
    serving-grammar) json_tokenizer; SERVER_ARGS="--tokenizer $JTOK" serving serving-grammar --constrained-fraction 0.5 ;;
    profile) step profile 200 python3 $S/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
               --batch-sizes 1,64,256 --graphs on --steps 16 --torch-profile ;;
    cprofile) step cprofile 200 python3 $S/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
               --batch-sizes 1,64 --graphs on --steps 32 --cprofile ;;
    bench-steps) step bench-steps 300 $BENCH --attention-backend auto --steps ;;
    decode) step decode 300 python3 $S/bench_decode.py --model "$MINISRV_GPU_CKPT" --attention-backend auto \
              --batch-sizes 1,64,256 --json "$OUT/decode.jsonl" ;;
    attn) step attn 500 python3 $S/bench_attention.py ;;
    # small decode batches (latency, not bandwidth), a tp 1 and a tp 2 rank's heads of Llama-3-8B
    attn-small) step attn-small 300 python3 $S/bench_attention.py --heads "32,8;16,4" --batch-sizes 1,2,4,8,16,32 \
                  --kv-dtypes bf16 --kernels fi,fi-tc,fa3 ;;
    # the small-batch FP8 GEMM (the launch rules' configurations) against torch._scaled_mm, tp 1's and a tp 2 rank's
    # shapes (--bandwidth: an H100's; pass 4.8e12 on an H200)
    gemm-fp8) step gemm-fp8 300 python3 $S/bench_small_m_gemm.py
              step gemm-fp8-tp2 300 python3 $S/bench_small_m_gemm.py --tp 2 ;;
    # the 256-request workload on one tp 2 rank's share and on the whole model, one GPU: tp 2's ceiling without
    # all-reduces or a second host process
    half-offline) need_llama8b; need_llama8b_half
                 for model in llama8b-half llama8b; do
                   step "offline-256-$model" 250 python3 $S/bench_offline.py --model /tmp/$model \
                     --json "$OUT/bench.jsonl"; done ;;
    half-profile) need_llama8b_half
              step half-profile 300 python3 $S/bench_decode.py --model /tmp/llama8b-half --attention-backend auto \
                  --batch-sizes 1 --graphs on --steps 16 --torch-profile ;;
    tp) wait_comm; step tp 500 python3 -X faulthandler -m pytest -q -s -o faulthandler_timeout=150 tests/gpu/test_tensor_parallel.py ;;
    # tensor parallelism's benchmark on a Llama-3-8B-shaped checkpoint: tp 1 against tp 2, in one lease
    tp-decode) need_llama8b
              for tp in ${TP_SIZES:-1 2}; do [ "$tp" -gt 1 ] && wait_comm
                step "tp$tp-decode" 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 32 --tp-size $tp --json "$OUT/decode.jsonl"; done ;;
    # tp 1 and tp 2 (fused all-reduce) decode steps with FA3 decoding instead of FlashInfer's
    tp-decode-fa) need_llama8b; wait_comm
              for tp in 1 2; do F=; [ "$tp" -gt 1 ] && F=--enable-flashinfer-allreduce-fusion
                step "tp$tp-decode-fa" 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend fa \
                  --batch-sizes 1,64 --graphs on --steps 32 --tp-size $tp $F --json "$OUT/decode.jsonl"; done ;;
    tp-fp8) need_llama8b; wait_comm
            step tp2-64-fp8 200 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 --tp-size 2 \
              --quantization fp8 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench.jsonl" ;;
    # the fused all-reduce + add + norm per call and its options, against NCCL then the norm (waits for comm-build)
    allreduce-fused) wait_comm; step allreduce-fused 300 python3 $S/bench_allreduce.py --tp-size 2 ;;
    # tp-profile with the all-reduce fusion: its kernel's time a call inside the decode step
    tp-profile-fused) need_llama8b; wait_comm
              step tp-profile-fused 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 16 --tp-size 2 --torch-profile \
                  --enable-flashinfer-allreduce-fusion ;;
    tp-offline) need_llama8b
              for tp in ${TP_SIZES:-1 2}; do [ "$tp" -gt 1 ] && wait_comm
                step tp$tp-64 200 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 --tp-size $tp \
                  --json "$OUT/bench.jsonl"
                step tp$tp-256 250 python3 $S/bench_offline.py --model /tmp/llama8b --tp-size $tp --json "$OUT/bench.jsonl"
              done ;;
    comm-build) (t=$SECONDS; python3 -c "from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g()" \
                   > /tmp/comm-build.log 2>&1; echo "comm build rc $? in $((SECONDS - t))s" >> /tmp/comm-build.log) &
                echo "comm-build started in the background (pid $!)"; COMM_PID=$! ;;
    # tp 2 with the all-reduce fusion: decode steps, then (unless DECODE_ONLY) the 64- and 256-request workloads
    tp-fused) need_llama8b; wait_comm
              step tp2-decode-fused 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 32 --tp-size 2 --enable-flashinfer-allreduce-fusion \
                  --log-level info --json "$OUT/decode.jsonl"
              [ -n "${DECODE_ONLY:-}" ] && continue
              step tp2-64-fused 200 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 --tp-size 2 \
                  --enable-flashinfer-allreduce-fusion --json "$OUT/bench.jsonl"
              step tp2-256-fused 250 python3 $S/bench_offline.py --model /tmp/llama8b --tp-size 2 \
                  --enable-flashinfer-allreduce-fusion --json "$OUT/bench.jsonl" ;;
    tp-cprofile) need_llama8b; wait_comm
              step tp-cprofile 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 32 --tp-size 2 --cprofile ;;
    # one GPU's decode step on the Llama-3-8B shape, kernel by kernel (the tp 1 side of tp-profile)
    decode-profile) need_llama8b
              step decode-profile 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 16 --torch-profile ;;
    tp-profile) need_llama8b; wait_comm
              step tp-profile 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                  --batch-sizes 1,64 --graphs on --steps 16 --tp-size 2 --torch-profile ;;
    llama8b) need_llama8b
             step llama8b 400 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 --json "$OUT/bench.jsonl" ;;
    # FP8: Llama-3-8B-shaped, 64 requests, FP8 weights and KV; decode steps in bf16, FP8 KV, FP8 weights + KV
    llama8b-fp8) need_llama8b
             step llama8b-fp8 400 python3 $S/bench_offline.py --model /tmp/llama8b --num-prompts 64 \
               --quantization fp8 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench.jsonl" ;;
    decode-fp8) need_llama8b
             for mode in "" "--kv-cache-dtype fp8_e4m3" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do
               step "decode-8b $mode" 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                 --batch-sizes 1,64,256 --graphs on --steps 32 $mode --json "$OUT/decode.jsonl"; done ;;
    decode-fp8w) need_llama8b; step decode-8b-fp8w 300 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
                 --batch-sizes 1,64,256 --graphs on --steps 32 --quantization fp8 --kv-cache-dtype fp8_e4m3 \
                 --json "$OUT/decode.jsonl" ;;
    profile-fp8) need_llama8b
             step profile-fp8 200 python3 $S/bench_decode.py --model /tmp/llama8b --attention-backend auto \
               --batch-sizes 1,64 --graphs on --steps 16 --quantization fp8 --kv-cache-dtype fp8_e4m3 --torch-profile ;;
    # mixtures of experts: the fused kernel against the torch path, a random Qwen3-MoE end to end against HF
    moe) step moe 500 python3 -m pytest -q -s -rs tests/gpu/test_fused_moe.py tests/gpu/test_moe.py ;;
    moe-align) step moe-align 200 python3 $S/bench_fused_moe.py --align --tokens 1,8,16,64,128,256,512,1024,2048 ;;
    moe-kernel) step moe-kernel 200 python3 $S/bench_fused_moe.py --tokens 1,2,4,8,64,256,2048
                step moe-kernel-fp8 200 python3 $S/bench_fused_moe.py --fp8 --tokens 1,2,4,8,64,256,2048 ;;
    # the Qwen3-30B-A3B-shaped checkpoint: the 256-request workload and decode steps, bf16 then FP8 experts
    moe-bench) need_moe
               for q in "" "--quantization fp8"; do
                 step "moe-offline $q" 400 python3 $S/bench_offline.py --model /tmp/moe $q --json "$OUT/bench.jsonl"
                 step "moe-decode $q" 300 python3 $S/bench_decode.py --model /tmp/moe --attention-backend auto \
                   --batch-sizes 1,64,256 --graphs on --steps 32 $q --json "$OUT/decode.jsonl"; done ;;
    # decode steps at a short context (128 tokens: the KV a step reads is small beside the weights) and where the
    # time of a step goes, batch 1 and 256
    moe-decode) need_moe; step moe-decode 300 python3 $S/bench_decode.py --model /tmp/moe --attention-backend auto \
                  --batch-sizes 1,64,256 --graphs on --steps 32 --repeats 3 --context 128 --json "$OUT/decode.jsonl" ;;
    moe-decode-fa) need_moe; step moe-decode-fa 300 python3 $S/bench_decode.py --model /tmp/moe --attention-backend fa \
                  --batch-sizes 1,64,256 --graphs on --steps 32 --repeats 3 --context 128 --json "$OUT/decode.jsonl" ;;
    moe-profile) need_moe; step moe-profile 300 python3 $S/bench_decode.py --model /tmp/moe --attention-backend ${BACKEND:-auto} \
                   --batch-sizes 1,256 --graphs on --steps 8 --context 128 --torch-profile ;;
    # each product alone under other launch configurations (to choose config_for's)
    moe-sweep) C="32,64,128,4,4;32,64,64,4,4;32,128,64,4,4;32,64,128,4,3;16,64,128,4,3;16,64,128,4,5;16,32,128,4,4;16,128,128,4,4;16,64,256,4,3;16,64,64,4,6;32,32,128,4,4;64,64,64,4,4;16,64,128,8,4;16,32,256,4,4;64,128,64,8,4;64,128,64,4,4"
               step moe-sweep 280 python3 $S/bench_fused_moe.py --products --tokens 16,32,64,128,256,384 --configs "$C"
               C8=$(echo "$C" | awk -F';' '{for(i=1;i<=NF;i++){split($i,a,",");printf "%s%s,%s,%s,%s,%s",(i>1?";":""),a[1],a[2],a[3]*2,a[4],a[5]}}')
               step moe-sweep-fp8 280 python3 $S/bench_fused_moe.py --products --fp8 --tokens 16,32,64,128,256,384 --configs "$C8" ;;
    # start-up, launch to the first chat answer (bench_startup.py): on a new machine the first run of `startup` finds
    # Triton's and FlashInfer's caches empty (the server starts on its stand-in kernels and is kept until it has
    # switched: --until-built), the later ones warm; startup-fresh empties them for its run
    startup) step startup 580 python3 $S/bench_startup.py --runs 3 --print-log --until-built -- --model "$MINISRV_GPU_CKPT" ;;
    startup-fresh) step startup-fresh 580 python3 $S/bench_startup.py --runs 1 --fresh-caches --print-log --until-built \
                     -- --model "$MINISRV_GPU_CKPT" ;;
    startup-fi) step startup-fi 580 python3 $S/bench_startup.py --runs 2 --print-log --until-built -- --model "$MINISRV_GPU_CKPT" \
                  --attention-backend fi ;;
    startup-8b) need_llama8b; step startup-8b 400 python3 $S/bench_startup.py --runs 2 --print-log --until-built -- --model /tmp/llama8b ;;
    # what the engine process imports, slowest last
    imports) step imports 120 bash -c "python3 -X importtime -c 'import minisrv.server.launch_server, minisrv.engine.engine, flashinfer, flash_attn_interface' 2>&1 | sort -t'|' -k2 -n | tail -n 25" ;;
    # mini-SGLang's fused MoE on the same checkpoint (carry .peers: ../shared/peers/setup_peers.sh), its two sgl-kernel
    # ops replaced by tests/gpu/peer_moe_ops.py; two runs (the first compiles its kernels)
    peer-moe) need_moe; grep -q "def moe_align_block_size" .peers/shims/sgl_kernel/__init__.py \
                || cat tests/gpu/peer_moe_ops.py >> .peers/shims/sgl_kernel/__init__.py
              for i in 1 2; do step peer-moe 300 env NUM=256 bash .peers/run.sh minisgl /tmp/moe; done ;;
    # minisrv's Triton decode kernel (fa,triton): its tests, the kernel beside FlashInfer's and FA3's at short and
    # long contexts (with the split counts the rule would not pick), and the decode steps and nano workload on it
    triton-tests) step triton-kernel 300 python3 -m pytest -q -rs tests/gpu/test_decode_attention.py
                  step triton-backend 400 python3 -m pytest -q -rs tests/gpu/test_backends.py tests/gpu/test_fp8_kv.py \
                    tests/gpu/test_cuda_graph.py tests/gpu/test_sampling.py tests/gpu/test_e2e.py -k "triton or test_greedy_and_prefill or argmax" ;;
    attn-triton) for ctx in 128 1024 4096; do
                   step "attn-triton $ctx" 200 python3 $S/bench_attention.py --heads "32,4;16,8" --batch-sizes 1,64,256 \
                     --context $ctx --kv-dtypes bf16 --kernels fi-tc,fa3,triton,triton-s1,triton-s2,triton-s4; done ;;
    attn-triton-tune) V=""; for t in 32 64 128; do for w in 4 8; do for st in 2 3 4; do V="$V,triton:tile=$t/num_warps=$w/num_stages=$st/min_chunk=128"; done; done; done
                 for ctx in 128 1024; do step "attn-triton-tune $ctx" 200 python3 $S/bench_attention.py --heads "32,4;16,8" \
                   --batch-sizes 64,256 --context $ctx --kv-dtypes bf16 --kernels "fi-tc,triton$V"; done ;;
    # fi against fi,triton (the same prefill; no FA3 needed, so any machine runs them)
    moe-decode-triton) need_moe; for b in fi fi,triton; do step "moe-decode $b" 300 python3 $S/bench_decode.py --model /tmp/moe \
                  --attention-backend $b --batch-sizes 1,64,256 --graphs on --steps 32 --repeats 3 --context 128 --json "$OUT/decode.jsonl"; done ;;
    decode-triton) for b in fi fi,triton; do step "decode $b" 300 python3 $S/bench_decode.py --model "$MINISRV_GPU_CKPT" \
                  --attention-backend $b --batch-sizes 1,64,256 --graphs on --steps 32 --json "$OUT/decode.jsonl"; done ;;
    bench-triton) for b in fi fi,triton fi fi,triton; do step "bench $b" 300 $BENCH --attention-backend $b; done ;;
    # the default (auto: fa,triton on Hopper) against fa,fi, alternated: nano, then the MoE checkpoint's workload
    bench-ab) for b in fa,fi auto fa,fi auto; do step "bench $b" 300 $BENCH --attention-backend $b; done ;;
    moe-offline-ab) need_moe; for b in fa,fi auto fa,fi auto; do step "moe-offline $b" 300 python3 $S/bench_offline.py \
                  --model /tmp/moe --attention-backend $b --json "$OUT/bench.jsonl"; done ;;
    moe-steps) need_moe; step moe-steps 400 python3 $S/bench_offline.py --model /tmp/moe --steps ;;
    # FP8 experts and projections: the workload, and decode steps at 128-token contexts
    moe-fp8) need_moe; step moe-offline-fp8 400 python3 $S/bench_offline.py --model /tmp/moe --quantization fp8 --json "$OUT/bench.jsonl"
             step moe-decode-fp8 300 python3 $S/bench_decode.py --model /tmp/moe --attention-backend auto --quantization fp8 \
               --batch-sizes 1,64,256 --graphs on --steps 32 --repeats 3 --context 128 --json "$OUT/decode.jsonl" ;;
    moe-offline) need_moe; step moe-offline 400 python3 $S/bench_offline.py --model /tmp/moe --json "$OUT/bench.jsonl" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
ls -la "$OUT" | tail -n +2
