#!/usr/bin/env bash
# Sourced by the GPU session scripts (gpu_session.sh, gpu_evolve_stream.sh): log() and
# step() over the caller's LOG, BUDGET and bash's SECONDS.
#   log MESSAGE...             a timestamped line to stdout and $LOG
#   step NAME MIN_SECONDS CMD  runs CMD when at least MIN_SECONDS of $BUDGET are left,
#                              bounded by what is left; logs its time and exit code

log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }

step() {
  local name="$1" need="$2"; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt "$need" ]; then log "SKIP $name: ${left}s left, needs ${need}s"; return 0; fi
  log "START $name (${left}s left): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$left" "$@" >>"$LOG" 2>&1
  local rc=$?
  log "END $name rc=$rc in $((SECONDS - t0))s"
  return 0
}
