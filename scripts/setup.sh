#!/usr/bin/env bash
# Create .venv in the repo and install the project (editable) with its test extras.
# Idempotent: a stamp of the inputs' hash makes a second run a no-op in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
TORCH_PIN="torch==2.13.0"
STAMP="$VENV/.setup-stamp"
inputs_hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$inputs_hash" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first: an unpinned dependency would otherwise pull a multi-GB CUDA build.
"${PIP[@]}" install "$TORCH_PIN"
"${PIP[@]}" install -e ".[test]"
echo "$inputs_hash" > "$STAMP"
echo "setup: environment ready in $VENV"
