#!/usr/bin/env bash
# Checks the documentation site: the generated reference pages must match the code (scripts/gen_docs.py --check),
# and `mkdocs build --strict` must pass, so a broken link or anchor, a page left out of the nav, or any other
# warning fails. Builds into a temporary folder and leaves the checkout as it was.
# PYTHON names the interpreter (default .venv/bin/python, which scripts/test.sh installs with mkdocs).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$python" scripts/gen_docs.py --check
# Not --quiet: it hides the warnings from the count that --strict fails on.
"$python" -m mkdocs build --strict --site-dir "$site"
echo "docs: reference pages current, site built with no warning"
