#!/usr/bin/env bash
# Issue 28 diagnosis on a GPU host: where a fresh 100k-row build's start-up goes.
#   1. each import chain alone, in an idle fresh interpreter (two runs each): what the
#      build's imports cost where nothing contends with them;
#   2. the fresh-process 100k build (bench_build_gpu.py --fresh-process-runs) as it is,
#      then with every library's thread pools at one thread (OMP_NUM_THREADS=1,
#      RAYON_NUM_THREADS=1): do the 16 join/token workers' own thread pools oversubscribe
#      the host's 16 CPUs while the builder imports?
#   3. the same build with DATASET_NUM_PROC=4: how much of the start-up is contention.
# Usage (repository root, .whl/.tok carried; OUT set):
#   bash benchmarks/diag_startup.sh --commit SHA [--tok .tok] [--runs 2]
set -u -o pipefail
COMMIT=""; TOK=".tok"; RUNS=2; ROWS="${ROWS:-100000}"
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT="$2"; shift 2 ;;
    --tok) TOK="$2"; shift 2 ;;
    --runs) RUNS="$2"; shift 2 ;;
    *) echo "error: diag_startup.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
: "${OUT:?set OUT to the results folder}"
LOG="$OUT/diag_startup.log"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -n "$COMMIT" ] && export BENCH_TREE_COMMIT="$COMMIT"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

wall() {  # wall of one fresh interpreter running $1 (pinned like the build)
  local s e
  s=$(date +%s%N)
  taskset -c 0-15 "$PY" -c "$1" >/dev/null 2>>"$LOG" || log "FAILED: $1"
  e=$(date +%s%N)
  echo "$(( (e - s) / 1000000 ))"
}

log "host: $(nproc) CPUs; $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
for i in $(seq 1 2); do
  log "idle imports run $i (ms):" \
    "python=$(wall 'pass')" \
    "torch=$(wall 'import torch')" \
    "torch+datasets=$(wall 'import torch, datasets')" \
    "torch+tokenizers=$(wall 'import torch, tokenizers')" \
    "transformers_base=$(wall 'import torch; from transformers import PreTrainedTokenizerBase')" \
    "transformers_model=$(wall 'import torch; from transformers import AutoModel; import transformers.models.bert.modeling_bert')" \
    "cuda_init=$(wall 'import torch; torch.zeros(1, device="cuda"); torch.cuda.synchronize()')"
done

build() {  # build NAME [ENV=VALUE ...]: the fresh 100k build, RUNS processes
  local name="$1"; shift
  log "build $name: env $*"
  env "$@" taskset -c 0-15 "$PY" benchmarks/bench_build_gpu.py --rows "$ROWS" \
    --samples-per-shard 1000 --fresh-process-runs "$RUNS" --dtype float16 \
    --random-minilm "$TOK" --work-dir "/dev/shm/diag_$name" \
    --json "$OUT/diag_$name.json" >>"$LOG" 2>&1 || log "build $name FAILED"
  "$PY" - "$OUT/diag_$name.json" <<'EOF' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))["results"]
print("  walls", r["fresh_process_walls_s"])
for s in r["startup"] if isinstance(r["startup"], list) else [r["startup"]]:
    print("  ", json.dumps(s["seconds"]))
EOF
  rm -rf "/dev/shm/diag_$name"
}
build base DATASET_NUM_PROC=16
build onethread DATASET_NUM_PROC=16 OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 MKL_NUM_THREADS=1
build proc4 DATASET_NUM_PROC=4
log "done"
