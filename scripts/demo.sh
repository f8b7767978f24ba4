#!/usr/bin/env bash
# Sets up a virtual environment with ma-runtime and runs the demo training job under ma-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e .
export MA_HOME="${MA_HOME:-$PWD/.ma-runtime}"
echo "== ma-run --config examples/job.yaml -- python examples/train.py"
status=0
.venv/bin/ma-run --config examples/job.yaml -- .venv/bin/python examples/train.py || status=$?
echo "== exit code: $status"
echo "== task log: $(ls "$MA_HOME"/modelarts/log/*.log)"
echo "== model: $(cat "$MA_HOME"/modelarts/outputs/train_url_0/model.json)"
echo "== synced to the output URL (a local folder standing in for obs://): $(ls -d .ma-runtime/demo-output/model.json)"
exit "$status"
