#!/usr/bin/env bash
# One call on a GPU host for issue 28's figures, in order, under a time budget; every
# result under $OUT (at most 8 files, one folder deep). On one GPU (an nvidia-h200 lease:
# 1 H200, 16 CPUs) the 4-GPU steps (the 4-rank pairs, the GPU-0 test) are skipped with a
# logged reason and build_minilm_1m.json is written instead; the rest fits in 540 s:
#
#   session.log              this script's log: versions, GPUs, each step's command, time, exit
#   fresh_100k.json          bench_build_gpu.py --fresh-process-runs 5: 100k-row demo built by
#                            scripts/prebuild_cache.py in 5 fresh processes (fresh_process_walls_s,
#                            first shard after prepare_cache's entry, exit after the last line)
#   ranks_minilm_1m.json     bench_build_ranks.py: one builder vs 4 ranks, random MiniLM fp16,
#                            encoder.compile: graphs (speedup, rows_in, card, commit)
#   nvidia_smi_apps.txt      nvidia-smi's compute processes sampled every 250 ms during that
#                            4-rank build (and its exit), then each pid's GPUs: a rank on a GPU
#                            other than its own is the GPU-0 leak of issue 28
#   ranks_gemma_1m.json      the same pair, random gemma-3-270m shape, bf16, eager
#   compile_share.json       bench_compile_share.py: a compiled gemma encoder's warm-up cold and
#                            with the first process's shared compile artifacts
#   build_minilm_1m.json     (fewer than 4 GPUs) bench_build_gpu.py: a 1M-row one-builder
#                            build, random MiniLM fp16: the embed stage vs the bare forward
#   mfu_gemma.json           bench_embed.py: the bare gemma-shape bf16 forward (eager and the
#                            defaults, i.e. torch.compile), rows/s and MFU (989 TFLOP/s peak)
#
# Usage (repository root; .whl holds datasets/dill/fsspec/multiprocess wheels for Python
# 3.12 and .tok a MiniLM tokenizer folder, both carried):
#   bash benchmarks/gpu_session.sh --commit SHA [--budget 540] [--tiny]
# --commit SHA: the sending checkout's HEAD (clean), exported as BENCH_TREE_COMMIT, which
# every result file then carries (benchmarks/_results.py).
# --tiny: a CPU smoke run with tiny sizes (2 ranks, no gemma builds), same files.
set -u -o pipefail

BUDGET=540
COMMIT=""
TINY=0
TOK=".tok"
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --tokenizer) TOK="$2"; shift 2 ;;
    *) echo "error: gpu_session.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$COMMIT" ] && ! [[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
  # A short sha is ignored by benchmarks/_results.py (the stale .git's commit gets stamped).
  echo "error: gpu_session.sh: --commit takes the full 40-hex sha, got '$COMMIT'" >&2; exit 2
fi
if [ -z "${OUT:-}" ]; then echo "error: gpu_session.sh: set OUT to the results folder" >&2; exit 2; fi
if [ ! -d "$TOK" ]; then echo "error: gpu_session.sh: tokenizer folder $TOK missing" >&2; exit 2; fi
mkdir -p "$OUT"
LOG="$OUT/session.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "$COMMIT" ]; then export BENCH_TREE_COMMIT="$COMMIT"; fi
# NVLink multicast stays off (the host's rule), also in the processes we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECONDS=0
# The lent hosts' image holds no bytecode and sets PYTHONDONTWRITEBYTECODE=1: without this
# every fresh process compiles torch and transformers from source (benchmarks/NOTES.md).
# shellcheck disable=SC1091
. "$(dirname "$0")/precompile.sh"

# shellcheck disable=SC1091
. "$(dirname "$0")/session_steps.sh"  # log, step

# The Python packages the image lacks (datasets and its dill/multiprocess), from .whl.
if ! "$PY" -c "import datasets, multiprocess" 2>/dev/null; then
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || { log "wheel install failed"; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Where the data goes: memory (tmpfs) when it has room for the 1M-row runs, else /tmp.
WORK="${WORK:-}"
if [ -z "$WORK" ]; then
  free_gb=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  if [ "${free_gb:-0}" -ge 120 ] && [ "$TINY" = 0 ]; then WORK=/dev/shm/hfp_session; else WORK=/tmp/hfp_session; fi
fi
mkdir -p "$WORK"

log "commit ${COMMIT:-unknown}, budget ${BUDGET}s, tiny=$TINY, work $WORK"
{ nvidia-smi -L; nvidia-smi --query-gpu=index,pci.bus_id,name,memory.used --format=csv; } >>"$LOG" 2>&1
"$PY" -c "import sys, torch, transformers, datasets; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), 'GPUs', transformers.__version__, datasets.__version__)" >>"$LOG" 2>&1
NCPU=$(nproc)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
log "$NGPU GPUs visible, $NCPU CPUs"
# The 4-GPU steps run with 4 GPUs (or in a --tiny CPU smoke run, with 2 CPU ranks).
FOUR=0
if [ "$NGPU" -ge 4 ] || [ "$TINY" = 1 ]; then FOUR=1; fi


if [ "$TINY" = 1 ]; then
  FRESH=(--rows 400 --samples-per-shard 100 --fresh-process-runs 2 --dtype float32 --set build.num_proc=2)
  RANKS=(--rows 800 --samples-per-shard 100 --ranks 2 --dtype float32 --no-write-reference --timeout 600)
  COMPILE=(--random-minilm "$TOK" --dtype float32 --device cpu)
  MFU=(--models minilm --dtypes float32 --variants eager --minilm-rows 256 --repeat 1)
  ONE=(--rows 400 --samples-per-shard 100 --dtype float32 --set build.num_proc=2)
else
  FRESH=(--rows 100000 --samples-per-shard 1000 --fresh-process-runs 5 --dtype float16)
  RANKS=(--rows 1000000 --samples-per-shard 2000 --ranks 4 --pin --no-write-reference --one-num-proc 16 --timeout 240)
  COMPILE=(--random-gemma "$TOK" --dtype bfloat16)
  MFU=(--models gemma --dtypes bfloat16 --variants eager,defaults --gemma-rows 30000 --repeat 2)
  ONE=(--rows 1000000 --samples-per-shard 2000 --dtype float16)
fi

# 1. The 100k-row demo by a fresh process, 5 times, on 16 CPUs of its own (a node's share
#    of the issue's hosts; 16 workers: DATASET_NUM_PROC) and GPU 0.
PIN=()
if [ "$NCPU" -ge 16 ] && command -v taskset >/dev/null; then PIN=(taskset -c 0-15); fi
step fresh_100k 60 env DATASET_NUM_PROC="$((NCPU < 16 ? NCPU : 16))" CUDA_VISIBLE_DEVICES=0 \
  "${PIN[@]}" "$PY" benchmarks/bench_build_gpu.py "${FRESH[@]}" --random-minilm "$TOK" \
  --work-dir "$WORK/fresh" --json "$OUT/fresh_100k.json"
rm -rf "$WORK/fresh"

# 2. One builder vs 4 ranks, MiniLM (graphs), with nvidia-smi's process list sampled;
#    with fewer than 4 GPUs, a 1M-row one-builder build (its report: the embed stage
#    beside the bare forward on the same token ids).
if [ "$FOUR" = 0 ]; then
  log "SKIP ranks_minilm_1m, ranks_gemma_1m: need 4 GPUs, $NGPU visible"
  step build_minilm_1m 120 env DATASET_NUM_PROC="$((NCPU < 16 ? NCPU : 16))" CUDA_VISIBLE_DEVICES=0 \
    "$PY" benchmarks/bench_build_gpu.py "${ONE[@]}" --random-minilm "$TOK" \
    --work-dir "$WORK/one" --json "$OUT/build_minilm_1m.json"
  rm -rf "$WORK/one"
fi
APPS="$OUT/nvidia_smi_apps.txt"
SAMPLER=""
if command -v nvidia-smi >/dev/null && [ "$TINY" = 0 ] && [ "$FOUR" = 1 ]; then
  nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader >"$APPS" 2>&1
  nvidia-smi --query-compute-apps=timestamp,pid,gpu_bus_id,used_memory --format=csv,noheader \
    -lms 250 >>"$APPS" 2>&1 &
  SAMPLER=$!
fi
[ "$FOUR" = 1 ] && step ranks_minilm_1m 150 "$PY" benchmarks/bench_build_ranks.py "${RANKS[@]}" \
  --random-minilm "$TOK" --dtype "$([ "$TINY" = 1 ] && echo float32 || echo float16)" \
  --work-dir "$WORK/ranks" --json "$OUT/ranks_minilm_1m.json"
if [ -n "$SAMPLER" ]; then
  sleep 1  # the last rank's exit
  kill "$SAMPLER" 2>/dev/null; wait "$SAMPLER" 2>/dev/null
  "$PY" - "$APPS" >>"$APPS" 2>&1 <<'EOF'
import sys
from collections import defaultdict

lines = open(sys.argv[1]).read().splitlines()
index = {}
seen = defaultdict(set)
for line in lines:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[0].isdigit():
        index[parts[1].lower()] = parts[0]
    elif len(parts) == 4 and parts[1].isdigit():
        seen[parts[1]].add(index.get(parts[2].lower(), parts[2]))
print("# pid -> GPUs it held a context on, over the 4-rank build and its exit")
for pid, gpus in sorted(seen.items()):
    print(f"# pid {pid}: GPUs {sorted(gpus)}" + ("  <-- more than one GPU" if len(gpus) > 1 else ""))
print(f"# processes on more than one GPU: {sum(len(g) > 1 for g in seen.values())}")
EOF
fi

# 3. The same pair with the gemma-3-270m shape (bf16, eager: nothing compiles per rank).
if [ "$TINY" = 0 ] && [ "$FOUR" = 1 ]; then
  step ranks_gemma_1m 200 "$PY" benchmarks/bench_build_ranks.py "${RANKS[@]}" \
    --random-gemma "$TOK" --dtype bfloat16 --set encoder.compile=eager \
    --work-dir "$WORK/ranks" --json "$OUT/ranks_gemma_1m.json"
fi
rm -rf "$WORK/ranks"

# 3b. No process on a GPU it was not given, at exit too (tests/test_embed_cuda.py, NVML).
if [ "$TINY" = 0 ] && [ "$NGPU" -lt 2 ]; then
  log "SKIP gpu_owner_test: needs 2 GPUs (a process given GPU 1), $NGPU visible"
elif [ "$TINY" = 0 ]; then
  step gpu_owner_test 40 "$PY" -m pytest -q -p no:cacheprovider tests/test_embed_cuda.py
fi

# 4. A compiled encoder's warm-up: cold, then with the shared artifacts.
step compile_share 60 "$PY" benchmarks/bench_compile_share.py "${COMPILE[@]}" \
  --work-dir "$WORK/compile" --json "$OUT/compile_share.json"

# 5. The bare gemma-shape bf16 forward's MFU; its compile reuses what step 4 left in the
#    second process's inductor cache (same graphs), so only the defaults' tracing is paid.
step mfu 40 env TORCHINDUCTOR_CACHE_DIR="$WORK/compile/inductor-shared" \
  TRITON_CACHE_DIR="$WORK/compile/triton-shared" \
  "$PY" benchmarks/bench_embed.py "${MFU[@]}" --tokenizer "$TOK" --warm-compile-cache \
  --deadline "$((BUDGET - SECONDS - 30))" --json "$OUT/mfu_gemma.json"

log "done in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')"
