#!/usr/bin/env bash
# One call on a 1-GPU host (an nvidia-h200 lease: 1 H200, 16 CPUs) for the figures of
# issues 26 (a cache that evolves), 27 (streaming) and 28 (the 100k fresh build), in that
# order, under a time budget; every result under $OUT (at most 8 files, one folder deep):
#
#   session.log          this script's log: versions, each step's command, time, exit
#   evolve_1m.json       bench_evolve.py, 1M rows, random MiniLM fp16: scratch, base,
#                        append 10%, touch, index hit, re-embed, another caption column
#   evolve_append.json   (--append-repeats N > 0) bench_evolve.py --append-only --repeats N
#   reembed_gemma_1m.json (step reembed_gemma) bench_evolve.py --reembed-only, 1M rows, a
#                        random gemma-3-270m-shaped encoder in bf16 (the issue's COYO
#                        encoder): scratch, then another encoder.max_length over it
#   evolve_gemma_1m.json (step evolve_gemma) bench_evolve.py --no-recaption with that
#                        gemma-shaped encoder: scratch, base, append 10%, touch, index hit,
#                        re-embed (COYO's encoder: configs/coyo11m.yaml)
#   append_gemma_1m.json (step append_gemma) bench_evolve.py --append-only with it,
#                        --repeats --gemma-repeats (default 1); with --gemma-baseline
#                        DIR (a carried checkout of another commit: hf_pipeline, dist)
#                        the same builds with its code too, taking turns
#   hashing_w{8,16}.json bench_identity.py: content hashing GB/s on this host's tmpfs, 8
#                        (the default) and 16 threads
#   stream_93k.json      bench_stream.py, 96 shards x 1000 rows, 50 ms per request (or
#                        --stream-latencies), concurrency 64, block and global shuffle,
#                        --repeats 3 (or --stream-repeats; --stream-pull: with the
#                        pull-first comparison), stream worker processes
#                        --stream-workers (default "1": in the loader's process, each
#                        value in turn) behind --stream-proxies latency proxy processes
#   fresh_100k.json      bench_build_gpu.py --fresh-process-runs 5 (the 100k demo)
#
# Usage (repository root; carry .whl (datasets/dill/multiprocess), .gw (gcsfs and its
# needs), .fgcs (the fake-gcs-server wrapper) and .tok (a MiniLM tokenizer folder)):
#   bash benchmarks/gpu_evolve_stream.sh --commit SHA [--budget 560] [--steps evolve,evolve_gemma,append_gemma,reembed_gemma,hashing,stream,fresh]
#        [--append-repeats N] [--gemma-repeats N] [--gemma-baseline DIR] [--gemma-set KEY=VALUE] [--stream-latencies "0 50"] [--stream-pull]
#        [--stream-workers "1 4 8"] [--stream-proxies 4] [--stream-repeats 2]
set -u -o pipefail

BUDGET=560
COMMIT=""
STEPS="evolve,hashing,stream,fresh"
APPEND_REPEATS=0
GEMMA_REPEATS=1
GEMMA_BASELINE=""
GEMMA_SET=()
STREAM_LATENCIES="50"
STREAM_PULL="--no-pull"
STREAM_WORKERS="1"
STREAM_PROXIES=1
STREAM_REPEATS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --append-repeats) APPEND_REPEATS="$2"; shift 2 ;;
    --gemma-repeats) GEMMA_REPEATS="$2"; shift 2 ;;  # append_gemma's --repeats
    --gemma-baseline) GEMMA_BASELINE="$2"; shift 2 ;;  # append_gemma's --baseline before=DIR
    --gemma-set) GEMMA_SET+=(--set "$2"); shift 2 ;;  # e.g. encoder.compile=auto (COYO's)
    --stream-latencies) STREAM_LATENCIES="$2"; shift 2 ;;  # e.g. "0 50"
    --stream-pull) STREAM_PULL=""; shift ;;  # also time pulling the whole cache first
    --stream-workers) STREAM_WORKERS="$2"; shift 2 ;;  # e.g. "1 4 8"
    --stream-proxies) STREAM_PROXIES="$2"; shift 2 ;;  # latency proxy processes
    --stream-repeats) STREAM_REPEATS="$2"; shift 2 ;;
    *) echo "error: gpu_evolve_stream.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "$COMMIT" ] && ! [[ "$COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
  echo "error: gpu_evolve_stream.sh: --commit takes the full 40-hex sha, got '$COMMIT'" >&2; exit 2
fi
if [ -z "${OUT:-}" ]; then echo "error: gpu_evolve_stream.sh: set OUT to the results folder" >&2; exit 2; fi
NEEDED=".tok .whl"
if [[ ",$STEPS," == *",stream,"* ]]; then NEEDED="$NEEDED .gw .fgcs"; fi  # gcsfs, the emulator
for d in $NEEDED; do
  [ -d "$d" ] || { echo "error: gpu_evolve_stream.sh: $d missing (carry it)" >&2; exit 2; }
done
mkdir -p "$OUT"
LOG="$OUT/session.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
if [ -n "$COMMIT" ]; then export BENCH_TREE_COMMIT="$COMMIT"; fi
SECONDS=0
# shellcheck disable=SC1091
. "$(dirname "$0")/session_steps.sh"  # log, step

"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl $( [ -d .gw ] && echo .gw/*.whl) >>"$LOG" 2>&1 || { log "wheel install failed"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/.fgcs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC1091
. "$(dirname "$0")/precompile.sh" >>"$LOG" 2>&1
log "commit ${COMMIT:-unknown}, budget ${BUDGET}s, steps $STEPS"
nvidia-smi -L >>"$LOG" 2>&1
"$PY" -c "import sys, torch, transformers, datasets, gcsfs; print(sys.version.split()[0], torch.__version__, transformers.__version__, datasets.__version__, gcsfs.__version__)" >>"$LOG" 2>&1
NCPU=$(nproc)
NP=$((NCPU < 16 ? NCPU : 16))
WORK=/dev/shm/hfp
mkdir -p "$WORK"
"$PY" -c "from pathlib import Path; from benchmarks.random_models import save_random_model; save_random_model('minilm', Path('$WORK/m'), '.tok')" >>"$LOG" 2>&1 \
  || { log "random MiniLM failed"; exit 1; }

want() { [[ ",$STEPS," == *",$1,"* ]]; }
# The gemma steps say their compile setting (configs/demo.yaml's graphs unless told).
if [[ " ${GEMMA_SET[*]-} " != *" encoder.compile="* ]]; then GEMMA_SET+=(--set encoder.compile=graphs); fi

if want evolve; then
  step evolve_1m 200 env DATASET_NUM_PROC="$NP" "$PY" benchmarks/bench_evolve.py \
    --rows 1000000 --samples-per-shard 2000 --dtype float16 --random-minilm .tok \
    --work-dir "$WORK/evo" --json "$OUT/evolve_1m.json"
  rm -rf "$WORK/evo"
fi
if [ "$APPEND_REPEATS" -gt 0 ]; then
  step evolve_append 150 env DATASET_NUM_PROC="$NP" "$PY" benchmarks/bench_evolve.py \
    --rows 1000000 --samples-per-shard 2000 --dtype float16 --random-minilm .tok \
    --append-only --repeats "$APPEND_REPEATS" --work-dir "$WORK/evoa" --json "$OUT/evolve_append.json"
  rm -rf "$WORK/evoa"
fi
if want reembed_gemma; then
  step reembed_gemma 420 env DATASET_NUM_PROC="$NP" "$PY" benchmarks/bench_evolve.py \
    --rows 1000000 --samples-per-shard 2000 --dtype bfloat16 --random-gemma .tok \
    --reembed-only --work-dir "$WORK/evg" --json "$OUT/reembed_gemma_1m.json"
  rm -rf "$WORK/evg"
fi
if want evolve_gemma; then
  step evolve_gemma 330 env DATASET_NUM_PROC="$NP" "$PY" benchmarks/bench_evolve.py \
    --rows 1000000 --samples-per-shard 2000 --dtype bfloat16 --random-gemma .tok --no-recaption \
    ${GEMMA_SET[@]+"${GEMMA_SET[@]}"} \
    --work-dir "$WORK/evgf" --json "$OUT/evolve_gemma_1m.json"
  rm -rf "$WORK/evgf"
fi
if want append_gemma; then
  TREES=$([ -n "$GEMMA_BASELINE" ] && echo 2 || echo 1)
  step append_gemma $((40 + 190 * GEMMA_REPEATS * TREES)) env DATASET_NUM_PROC="$NP" "$PY" benchmarks/bench_evolve.py \
    --rows 1000000 --samples-per-shard 2000 --dtype bfloat16 --random-gemma .tok \
    --append-only --repeats "$GEMMA_REPEATS" ${GEMMA_SET[@]+"${GEMMA_SET[@]}"} \
    $([ -n "$GEMMA_BASELINE" ] && echo --baseline "before=$PWD/$GEMMA_BASELINE") --work-dir "$WORK/evga" --json "$OUT/append_gemma_1m.json"
  rm -rf "$WORK/evga"
fi
if want hashing; then
  for w in 8 16; do
    step "hashing_w$w" 20 "$PY" benchmarks/bench_identity.py --files 32 --mb 256 --hit-files 10000 \
      --workers "$w" --chunks-kb 8192,2048,1024,256 --dir "$WORK/hash" --json "$OUT/hashing_w$w.json"
    rm -rf "$WORK/hash"
  done
fi
if want stream; then
  step stream_93k 150 "$PY" benchmarks/bench_stream.py --shards 96 --samples 1000 --batch 1024 \
    --block-size 1024 --ahead 32 --cache-mb 2048 --threads 8 --latency-ms $STREAM_LATENCIES \
    --concurrency 64 --no-ceiling $STREAM_PULL --repeats "$STREAM_REPEATS" --workers $STREAM_WORKERS \
    --proxies "$STREAM_PROXIES" --workdir "$WORK/bs96" --set encoder.model="$WORK/m" \
    --set encoder.device=cuda --set build.num_proc="$NP" --json "$OUT/stream_93k.json"
  rm -rf "$WORK/bs96"
fi
if want fresh; then
  PIN=()
  if [ "$NCPU" -ge 16 ] && command -v taskset >/dev/null; then PIN=(taskset -c 0-15); fi
  step fresh_100k 60 env DATASET_NUM_PROC="$NP" CUDA_VISIBLE_DEVICES=0 "${PIN[@]}" \
    "$PY" benchmarks/bench_build_gpu.py --rows 100000 --samples-per-shard 1000 \
    --fresh-process-runs 5 --dtype float16 --random-minilm .tok \
    --work-dir "$WORK/fresh" --json "$OUT/fresh_100k.json"
  rm -rf "$WORK/fresh"
fi
log "done in ${SECONDS}s; files: $(ls "$OUT" | tr '\n' ' ')"
