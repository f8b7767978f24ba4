#!/usr/bin/env bash
# Sets up a virtual environment with the test tools and runs lint and the whole test suite,
# then the suite again on Python 3.9 (what the Ascend base images ship) when one is installed.
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

setup() {  # setup PYTHON VENV
  "$1" -m venv "$2"
  "$2/bin/python" -m pip install --quiet --upgrade pip
  "$2/bin/python" -m pip install --quiet -e '.[test]'
}

setup python3 .venv
# The real launchers for the launcher tests: torch's CPU wheel (pinned: any other version
# downloads gigabytes of CUDA packages) in the test venv, MindSpore in a venv of its own, as a
# job's interpreter apart from the runtime's.
.venv/bin/python -m pip install --quiet torch==2.13.0
if [ ! -x .venv-ms/bin/msrun ]; then
  python3 -m venv .venv-ms
  .venv-ms/bin/python -m pip install --quiet mindspore==2.10.0
fi
.venv/bin/ruff check ma_runtime tests benchmarks examples
.venv/bin/python -m pytest -q "$@"

find_python39() {  # the first candidate that really runs 3.9 (a pyenv shim may exist and fail)
  for candidate in python3.9 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.9*/bin/python3.9 /usr/bin/python3.9; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 9)' >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}

py39=$(find_python39)
if [ -n "$py39" ]; then
  echo "== the same suite on $("$py39" --version)"
  setup "$py39" .venv39
  .venv39/bin/python -m pytest -q "$@"
else
  echo "python3.9 not found: the Python 3.9 run is skipped" >&2
fi
