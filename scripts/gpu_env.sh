# The GPU machine's set-up, sourced by tests/gpu/run.sh and scripts/gpu_bench.sh from the repository root.
# The machine has torch but not FlashAttention-3, FlashInfer or the server's packages: the wheel bundles carried in
# .gpu-wheels/ (fa3, fi, srv, tools; see docs/testing.md) are installed under /tmp and put on PYTHONPATH. FlashInfer
# compiles each kernel on first use (minutes): the kernels carried in .fi-cache/ are loaded as its prebuilt ones, and
# save_fi_cache copies newly built ones to $OUT to be carried next time. Logs go to $OUT (default ./gpu-out).
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$(bash .gpu-wheels/tools/install_on_device.sh 2>/dev/null):$PWD
export MINISRV_GPU_CKPT=${MINISRV_GPU_CKPT:-/tmp/qwen3}
# NVLink multicast stays off in every process (it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FI_CACHE=$HOME/.cache/flashinfer/0.6.13/90a/cached_ops
# FlashInfer rebuilds whatever is in its JIT cache but loads a module found in its AOT folder
# (<package>/data/aot/<name>/<name>.so) as is: the carried kernels go there (.fi-cache-* are subsets carried alone)
for f in .fi-cache-*/*.so; do [ -e "$f" ] && mkdir -p .fi-cache && { [ -e ".fi-cache/${f##*/}" ] || cp "$f" .fi-cache/; }; done
if [ -d .fi-cache ]; then
  FI_AOT=$(python3 -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("flashinfer").origin), "data", "aot"))')
  for f in .fi-cache/*.so; do [ -e "$f" ] || continue
    name=$(basename "$f" .so); mkdir -p "$FI_AOT/$name"; [ -e "$FI_AOT/$name/$name.so" ] || cp "$f" "$FI_AOT/$name/"; done
fi

# at most 8 files come back from a call: up to 5 newly built kernels (those already in .fi-cache/ are not sent again)
save_fi_cache() { ls -S "$FI_CACHE"/*/*.so 2>/dev/null | while read -r f; do
    [ -e ".fi-cache/$(basename "$f")" ] || echo "$f"; done | head -5 | while read -r f; do cp -u "$f" "$OUT/"; done; }

# need_checkpoint DIR SHAPE: a random-weight checkpoint of a real model's shape (qwen3-0.6b, llama3-8b,
# qwen3-30b-a3b-half), written once per machine
need_checkpoint() { [ -f "$1/config.json" ] || python3 .gpu-wheels/tools/make_checkpoint.py "$1" "$2" >/dev/null 2>&1; }

# Processes a runner starts run under `timeout`, which leads a process group of its own; their ids are kept in
# $GPU_PIDS so that a later run stops what a run cut off by the call's time limit left (holding GPU memory or
# FlashInfer's build locks): those groups and nothing else.
GPU_PIDS=/tmp/minisrv-gpu.pids
stop_leftovers() { [ -f $GPU_PIDS ] || return 0
  while read -r pid; do kill -- "-$pid" 2>/dev/null && echo "stopped process group $pid of an earlier run"; done < $GPU_PIDS
  rm -f $GPU_PIDS; }
# background LIMIT CMD...: start CMD under a time limit; its id in BG_PID (and in $GPU_PIDS)
background() { local limit=$1; shift; timeout "$limit" "$@" & BG_PID=$!; echo $BG_PID >> $GPU_PIDS; }
stop_leftovers
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
