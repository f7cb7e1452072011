#!/usr/bin/env bash
# Creates .venv and installs the package with its test and serve extras, pinned for a CPU machine.
# Safe to run again: an existing .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints-cpu.txt -e ".[test,serve]"
