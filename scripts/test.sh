#!/usr/bin/env bash
# Sets up a virtual environment with the test tools and runs lint and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The PID-1 comparison suite runs Debian's tini and dumb-init side by side with ma-run.
if ! command -v tini >/dev/null || ! command -v dumb-init >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tini dumb-init >/dev/null
  else
    echo "tini/dumb-init missing and not root: their comparison tests will be skipped" >&2
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test]'
.venv/bin/ruff check ma_runtime tests benchmarks examples
.venv/bin/python -m pytest -q "$@"
