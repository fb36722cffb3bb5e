#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md as named suites, run on a GPU machine from the repository root after the
# set-up of docs/testing.md (wheels carried in .gpu-wheels/):
#   bash scripts/gpu_bench.sh [--ab] SUITE...
# --ab runs every step on this tree and then on .baseline/ (an earlier checkout carried beside it; its steps are
# labelled @base), so that a change and what it replaced are measured in one lease. Suites:
#   offline   the nano workload: Qwen3-0.6B shape bf16 and FP8 KV, the Llama-3-8B shape (64 requests), the
#             Qwen3-30B-A3B half shape; mini-SGLang and nano-vLLM on the same checkpoints where .peers/ is carried
#   features  the other offline workloads: shared system prompts, long shared prefixes (+ cascade decode),
#             every request under a JSON schema, FP8 weights + KV on the 8B and MoE shapes
#   decode    decode steps by batch size: 0.6B, 8B (bf16, FP8 KV, FP8 weights + KV), MoE (bf16, FP8)
#   kernels   the kernels alone: decode attention, the fused experts, the small-batch FP8 GEMM
#   serving   bench_serving against a server: plain, half the requests constrained, the reasoning parser off / on
#   long      16 prompts of 16k-30k tokens (128-256 out), 0.6B shape, beside mini-SGLang (scripts/peer_long_prompts.py)
#   dp        two GPUs, 0.6B shape: the nano workload offline at dp 1 and 2 (LLM(dp_size)), then bench_serving at
#             saturation against --dp-size 1 and 2 (the HTTP process's CPU seconds printed after each run)
#   startup   launch to the first chat answer, 0.6B and 8B shapes
#   profile   where a decode step's time goes (torch profiler; the host's Python) on the three shapes
#   spec      speculative decoding's verify path at a set acceptance (drafts replayed from a plain run: decode and
#             verify on FA3, whose rounding matches, so a kept draft is the plain run's token), 0.6B, 8B, MoE half
#   int4      the Llama-3-8B shape as GPTQ 4-bit (group 128, written from the bf16 one): the kernel alone, decode
#             steps and the offline workload (64 and 256 requests) against bf16
#   gguf      the Llama-3-8B shape as a random GGUF in Q4_K_M's mix, kept in its blocks: resident bytes against the
#             file's, decode steps and the offline workload (64 requests)
#   int4-moe  the Qwen3-30B-A3B half shape with GPTQ 4-bit experts (group 128, written from the bf16 one): the
#             experts' 4-bit grouped GEMM alone, the offline workload and decode steps
#   gpt-oss   gpt-oss-20b with MXFP4 experts (random, scripts/make_hub_checkpoint.py): decode steps at batch 1 and 64,
#             the offline workload, where a decode step goes; on the fa attention backend (FA3's sinks), the decode
#             steps on torch too
#   gemma3    Gemma-3-12B (random, scripts/make_hub_checkpoint.py): 8 prompts of 32k tokens + 256 output tokens each
#             (retractions printed), and the KV its requests held per token of context at the peak
#   tp        two GPUs, Llama-3-8B shape: decode steps and the workload at tp 1, tp 2, tp 2 with the fused all-reduce;
#             the fused all-reduce alone; where a tp 2 step goes
# Each step's output is appended to $OUT/bench.log, results to $OUT/*.jsonl, and the output tok/s of every step that
# prints one to $OUT/summary.txt (printed at the end).
set -u
TREES=.
[ "${1:-}" = --ab ] && { TREES=". .baseline"; shift; }
[ $# -gt 0 ] || { sed -n 2,35p "$0"; exit 2; }
. scripts/gpu_env.sh
Q=$MINISRV_GPU_CKPT L=/tmp/llama8b M=/tmp/moe JTOK=/tmp/json-tokenizer TTOK=/tmp/think-tokenizer

# step LABEL LIMIT CMD...: CMD under a time limit; its tail printed, its output tok/s (if any) added to the summary
step() { local label=$1 limit=$2 t=$SECONDS rc; shift 2; echo "=== $label"
  background "$limit" "$@" > /tmp/gpu-step.log 2>&1; wait "$BG_PID"; rc=$?
  cat /tmp/gpu-step.log >> "$OUT/bench.log"; grep -v -E "Warning|warn\(" /tmp/gpu-step.log | tail -n 30
  local tps=$(sed -n -E 's/.*= ([0-9.]+) output tok\/s.*/\1/p; s/.*throughput=([0-9.]+)tok\/s.*/\1/p' /tmp/gpu-step.log | tail -n 1)
  [ -n "$tps" ] && printf "%-28s %10s output tok/s\n" "$label" "$tps" >> "$OUT/summary.txt"
  echo "=== $label done in $((SECONDS - t))s (rc $rc)"; save_fi_cache; }
# bench LABEL LIMIT SCRIPT ARGS...: scripts/SCRIPT once a tree (each tree's script imports its own minisrv)
bench() { local label=$1 limit=$2 script=$3 tree; shift 3
  for tree in $TREES; do step "$label$(tag $tree)" "$limit" python3 "$tree/scripts/$script" "$@"; done; }
tag() { [ "$1" = . ] || echo @base; }
# checkpoints SHAPE...: the random-weight checkpoints, written side by side before anything is timed
checkpoints() { local shape dir pids=
  for shape in "$@"; do case $shape in qwen3-0.6b) dir=$Q;; llama3-8b) dir=$L;; qwen3-30b-a3b-half) dir=$M;; esac
    [ -f $dir/config.json ] && continue
    background 600 python3 .gpu-wheels/tools/make_checkpoint.py $dir $shape > /dev/null 2>&1; pids="$pids $BG_PID"; done
  [ -z "$pids" ] || wait $pids; }
# hub_checkpoint SHAPE DIR: scripts/make_hub_checkpoint.py's random checkpoint (config.json, written last, marks one
# complete)
hub_checkpoint() { [ -f $2/config.json ] && return; rm -rf $2
  step make-$1 600 python3 scripts/make_hub_checkpoint.py $1 $2; }
# peer NAME CKPT NUM: a peer's offline run of the same workload (carry .peers: ../shared/peers/setup_peers.sh)
peer() { [ -f .peers/run.sh ] && step "$1-$(basename "$2")" 400 env NUM="$3" bash .peers/run.sh "$1" "$2"; }
# serve LABEL "SERVER FLAGS" BENCH_SERVING FLAGS...: bench_serving against a server of each tree on the 0.6B shape,
# started here and stopped by its id after
serve() { local label=$1 flags=$2 tree port=30123 spid; shift 2
  for tree in $TREES; do
    background 900 env PYTHONPATH="$PWD/$tree:$PYTHONPATH" python3 -P -m minisrv.launch_server --model $Q --port $port \
      $flags > "/tmp/$label-server.log" 2>&1; spid=$BG_PID
    for _ in $(seq 300); do kill -0 $spid 2>/dev/null || break
      python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" 2>/dev/null && break
      sleep 1; done
    # a first round, then idle seconds: a server's engines switch to their built kernels and CUDA graphs when idle
    # after a step (engine/kernel_builds.py), which must not happen inside the measured run
    python3 "$tree/scripts/bench_serving.py" --base-url http://127.0.0.1:$port --output /tmp/warm.json "$@" \
      --num-prompts 64 > /dev/null 2>&1; sleep 5
    local http=$(pgrep -P $spid | head -1) ticks=0  # the HTTP process (the engines are its children)
    [ -n "$http" ] && ticks=$(awk '{print $14 + $15}' /proc/$http/stat)
    step "$label$(tag $tree)" 300 python3 "$tree/scripts/bench_serving.py" --base-url http://127.0.0.1:$port \
      --output "/tmp/$label.json" "$@"
    [ -n "$http" ] && awk -v t0=$ticks -v hz=$(getconf CLK_TCK) '{printf "HTTP process CPU over the run: %.1f s\n", \
      ($14 + $15 - t0) / hz}' /proc/$http/stat
    python3 -c "import httpx; print('health:', httpx.get('http://127.0.0.1:$port/health').text)" 2>/dev/null
    kill $spid 2>/dev/null; wait $spid; done; }
OFFLINE="bench_offline.py --json $OUT/bench.jsonl"
DECODE="bench_decode.py --graphs on --steps 32 --json $OUT/decode.jsonl"

for suite in "$@"; do case $suite in
  offline) checkpoints qwen3-0.6b llama3-8b qwen3-30b-a3b-half
    bench nano 300 $OFFLINE --model $Q
    bench nano-fp8kv 300 $OFFLINE --model $Q --kv-cache-dtype fp8_e4m3
    bench llama8b-64 300 $OFFLINE --model $L --num-prompts 64
    bench moe 400 $OFFLINE --model $M
    peer minisgl $Q 256; peer nanovllm $Q 256; peer minisgl $L 64
    # mini-SGLang's MoE layer needs two sgl-kernel ops, replaced in its shims by torch ones for this run
    if [ -f .peers/run.sh ]; then grep -q "def moe_align_block_size" .peers/shims/sgl_kernel/__init__.py \
        || cat scripts/peer_moe_ops.py >> .peers/shims/sgl_kernel/__init__.py; peer minisgl $M 256; fi ;;
  features) checkpoints qwen3-0.6b llama3-8b qwen3-30b-a3b-half
    [ -f $JTOK/tokenizer.json ] || python3 scripts/json_tokenizer.py $JTOK $Q > /dev/null
    bench shared 300 $OFFLINE --model $Q --workload shared
    bench prefix-512 300 $OFFLINE --model $Q --workload prefix --max-output-len 512
    bench prefix-512-cascade 300 $OFFLINE --model $Q --workload prefix --max-output-len 512 --enable-cascade-attention
    bench grammar 300 $OFFLINE --model $Q --json-schema --tokenizer $JTOK --disable-radix-cache
    bench llama8b-64-fp8 300 $OFFLINE --model $L --num-prompts 64 --quantization fp8 --kv-cache-dtype fp8_e4m3
    bench moe-fp8 400 $OFFLINE --model $M --quantization fp8 ;;
  decode) checkpoints qwen3-0.6b llama3-8b qwen3-30b-a3b-half
    bench decode-0.6b 300 $DECODE --model $Q --batch-sizes 1,64,256
    bench decode-8b 300 $DECODE --model $L --batch-sizes 1,64,256
    bench decode-8b-fp8kv 300 $DECODE --model $L --batch-sizes 1,64,256 --kv-cache-dtype fp8_e4m3
    bench decode-8b-fp8 300 $DECODE --model $L --batch-sizes 1,64,256 --quantization fp8 --kv-cache-dtype fp8_e4m3
    bench decode-moe 300 $DECODE --model $M --batch-sizes 1,64,256 --repeats 3 --context 128
    bench decode-moe-fp8 300 $DECODE --model $M --batch-sizes 1,64,256 --repeats 3 --context 128 --quantization fp8 ;;
  kernels)
    bench attention 400 bench_attention.py
    bench fused-moe 200 bench_fused_moe.py --tokens 1,8,64,256,2048
    bench fused-moe-fp8 200 bench_fused_moe.py --fp8 --tokens 1,8,64,256,2048
    bench small-m-gemm 200 bench_small_m_gemm.py ;;
  serving) checkpoints qwen3-0.6b
    [ -f $JTOK/tokenizer.json ] || python3 scripts/json_tokenizer.py $JTOK $Q > /dev/null
    [ -f $TTOK/tokenizer.json ] || python3 scripts/think_tokenizer.py $TTOK $Q > /dev/null
    RANDOM_256="--num-prompts 256 --request-rate 64 --random-input-len 512 --random-output-len 256 --random-range-ratio 0.5"
    serve serving "" $RANDOM_256
    serve serving-grammar "--tokenizer $JTOK" $RANDOM_256 --constrained-fraction 0.5
    # the nano workload's lengths through the chat endpoint, all at once: every output is thinking for deepseek_r1
    NANO_CHAT="--endpoint chat --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.0977 --temperature 0.6"
    serve think-off "--tokenizer $TTOK" $NANO_CHAT
    serve think-on "--tokenizer $TTOK --reasoning-parser deepseek_r1" $NANO_CHAT ;;
  dp) checkpoints qwen3-0.6b  # two GPUs: one replica, then two, behind the one HTTP server, at saturation
    SATURATE="--num-prompts 1024 --request-rate inf --random-input-len 512 --random-output-len 256 --random-range-ratio 0.5 --warmup 64"
    bench dp1-offline 300 $OFFLINE --model $Q
    bench dp2-offline 300 $OFFLINE --model $Q --dp-size 2
    serve dp1 "" $SATURATE
    serve dp2 "--dp-size 2" $SATURATE ;;
  long) checkpoints qwen3-0.6b  # 16 prompts of 16k-30k tokens, 128-256 out; mini-SGLang on the same where .peers/ is
    LONG="--num-prompts 16 --min-input-len 16384 --max-input-len 30720 --min-output-len 128 --max-output-len 256"
    bench long-prompts 300 $OFFLINE --model $Q $LONG --steps
    bench long-prompts-chunk16k 300 $OFFLINE --model $Q $LONG --chunked-prefill-size 16384 --max-prefill-tokens 32768
    [ -f .peers/run.sh ] && step minisgl-long-prompts 400 bash .peers/run.sh minisgl $Q scripts/peer_long_prompts.py ;;
  startup) checkpoints qwen3-0.6b llama3-8b
    bench startup-0.6b 580 bench_startup.py --runs 3 --print-log --until-built -- --model $Q
    bench startup-8b 400 bench_startup.py --runs 2 --print-log --until-built -- --model $L ;;
  profile) checkpoints qwen3-0.6b llama3-8b qwen3-30b-a3b-half
    bench profile-0.6b 300 bench_decode.py --model $Q --graphs on --steps 16 --batch-sizes 1,64,256 --torch-profile
    bench cprofile-0.6b 300 bench_decode.py --model $Q --graphs on --steps 32 --batch-sizes 1,64 --cprofile
    bench profile-8b 300 bench_decode.py --model $L --graphs on --steps 16 --batch-sizes 1,64 --torch-profile
    bench profile-moe 300 bench_decode.py --model $M --graphs on --steps 8 --batch-sizes 1,256 --context 128 --torch-profile
    bench steps-moe 400 $OFFLINE --model $M --steps ;;
  spec) checkpoints qwen3-0.6b llama3-8b qwen3-30b-a3b-half
    # every batch size drafts (the limit raised) to price verifying there; then batch 64 under the default limit
    SPEC="bench_spec_replay.py --attention-backend fa --batch-sizes 1,8,32,64 --acceptance 1.0,0.7,0.0 --speculative-disable-by-batch-size 64"
    bench spec-8b-limit 200 bench_spec_replay.py --attention-backend fa --batch-sizes 64 --acceptance 0.7,0.0 --model $L
    bench spec-8b 400 $SPEC --model $L --json $OUT/spec.jsonl
    bench spec-0.6b 300 $SPEC --model $Q --json $OUT/spec.jsonl
    bench spec-moe 400 $SPEC --model $M --json $OUT/spec.jsonl ;;
  int4) checkpoints llama3-8b
    [ -f $L-gptq/config.json ] || step make-8b-gptq 300 python3 scripts/make_int4_checkpoint.py $L $L-gptq --format gptq --group 128
    bench w4a16-kernel 300 bench_w4a16.py --ms 1,2,4,16,64,256,1024,2048 --configs "0,128,64,1,4,1;128,128,64,1,8,3"
    for model in $L-gptq $L; do tag=$([ $model = $L ] && echo bf16 || echo gptq)
      bench decode-8b-$tag 300 $DECODE --model $model --batch-sizes 1,2,4,16,64
      bench llama8b-64-$tag 300 $OFFLINE --model $model --num-prompts 64
      bench llama8b-256-$tag 300 $OFFLINE --model $model; done ;;
  gguf) G=/tmp/llama8b-q4_k_m.gguf
    [ -f $G ] || step make-8b-gguf 300 python3 scripts/make_gguf_checkpoint.py $G
    step gguf-resident 300 python3 scripts/make_gguf_checkpoint.py $G --resident
    bench decode-8b-gguf 300 $DECODE --model $G --batch-sizes 1,2,4,16,64
    bench llama8b-64-gguf 300 $OFFLINE --model $G --num-prompts 64 ;;
  int4-moe) checkpoints qwen3-30b-a3b-half
    grep -q quantization_config $M-gptq/config.json 2>/dev/null || { rm -rf $M-gptq
      step make-moe-gptq 600 python3 scripts/make_int4_checkpoint.py $M $M-gptq --format gptq --group 128 --sym; }
    bench fused-moe-int4 200 bench_fused_moe.py --int4 128 --tokens 1,8,64,256,2048
    bench moe-gptq 400 $OFFLINE --model $M-gptq
    bench decode-moe-gptq 300 $DECODE --model $M-gptq --batch-sizes 1,64,256 --repeats 3 --context 128 ;;
  gpt-oss) O=/tmp/gpt-oss-20b
    hub_checkpoint gpt-oss-20b $O
    # the experts alone at gpt-oss-20b's shape: a decode step's pairs on their own kernel against the grouped GEMM
    bench fused-moe-mxfp4 200 bench_fused_moe.py --mxfp4 --experts 32 --top-k 4 --hidden 2880 --inter 2880 \
      --tokens 1,2,4,64,256 --no-reference --pair-configs "16,512,4;32,256,4;32,512,2;32,1024,4;16,1024,4;64,512,8;32,512,8"
    bench decode-gpt-oss 300 $DECODE --model $O --batch-sizes 1,64 --repeats 3 --attention-backend fa
    bench decode-gpt-oss-torch 300 $DECODE --model $O --batch-sizes 1,64 --repeats 3 --attention-backend torch
    bench gpt-oss 400 $OFFLINE --model $O --attention-backend fa
    bench profile-gpt-oss 300 bench_decode.py --model $O --attention-backend fa --graphs on --steps 8 --batch-sizes 1,64 \
      --torch-profile ;;
  gemma3) G3=/tmp/gemma3-12b
    hub_checkpoint gemma-3-12b $G3
    # long prompts want few windowed pages beside the full ones: SGLang's --swa-full-tokens-ratio, lowered
    bench gemma3-32k 600 $OFFLINE --model $G3 --num-prompts 8 --min-input-len 32768 --max-input-len 32768 \
      --min-output-len 256 --max-output-len 256 --swa-full-tokens-ratio 0.1 --log-level info
    # the pool's split at start and, at the run's peak, the KV its requests held per token of context
    grep -h -E "KV pool|KV at its peak" /tmp/gpu-step.log | sed -E 's/.*(KV (pool|at its peak).*)/\1/' ;;
  tp) checkpoints llama3-8b
    # FlashInfer's communication kernels (the fused all-reduce) build for minutes: beside the tp 1 runs
    background 600 python3 -c "from flashinfer.comm.trtllm_ar import get_trtllm_comm_module as g; g()" \
      > /tmp/comm-build.log 2>&1; comm=$BG_PID
    bench tp1-decode 300 $DECODE --model $L --batch-sizes 1,64 --tp-size 1
    bench tp1-64 300 $OFFLINE --model $L --num-prompts 64 --tp-size 1
    bench tp1-256 300 $OFFLINE --model $L --tp-size 1
    wait $comm; echo "comm build rc $?"
    for fused in "" --enable-flashinfer-allreduce-fusion; do f=${fused:+-fused}
      bench tp2-decode$f 300 $DECODE --model $L --batch-sizes 1,64 --tp-size 2 $fused
      bench tp2-64$f 300 $OFFLINE --model $L --num-prompts 64 --tp-size 2 $fused
      bench tp2-256$f 300 $OFFLINE --model $L --tp-size 2 $fused; done
    bench allreduce 300 bench_allreduce.py --tp-size 2
    bench tp2-profile 300 bench_decode.py --model $L --graphs on --steps 16 --batch-sizes 1,64 --tp-size 2 --torch-profile ;;
  *) echo "unknown suite $suite (see: bash scripts/gpu_bench.sh)" ;;
esac; done
echo "=== output tok/s"; cat "$OUT/summary.txt" 2>/dev/null
