#!/usr/bin/env bash
# Source this on a lent GPU host before timing fresh processes:
#   . benchmarks/precompile.sh
# Those hosts set PYTHONDONTWRITEBYTECODE=1 and their image's site-packages hold no
# bytecode (no __pycache__ under torch), so every fresh interpreter compiles torch,
# transformers and datasets from source: `import torch` 5.4 s and torch + transformers'
# modeling stack 14-27 s there (2026-12-02, benchmarks/NOTES.md). A user's
# `pip install` writes that bytecode once. This compiles everything on sys.path once into
# PYTHONPYCACHEPREFIX (a folder of its own: the image's folders stay as they are) and
# exports it, so the timed processes import as they would after a normal install.
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/pycache}"
unset PYTHONDONTWRITEBYTECODE
_precompile_start=$(date +%s)
# shellcheck disable=SC2046
"${PYTHON:-python3}" -m compileall -q -j 0 $("${PYTHON:-python3}" -c \
  'import sys, os; print(" ".join(p for p in sys.path if p and os.path.isdir(p)))') \
  >/dev/null 2>&1 || true
echo "precompile.sh: bytecode in $PYTHONPYCACHEPREFIX ($(( $(date +%s) - _precompile_start )) s)"
