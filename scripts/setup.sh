#!/usr/bin/env bash
# Creates .venv with torch and ran-hf (editable, with test extras). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned. Which build pip picks is pip's configuration: the CUDA build on an ordinary Linux machine,
# the CPU build where pip is pointed at CPU wheels (as on this project's CI machines).
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[dev]"
