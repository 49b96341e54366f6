#!/usr/bin/env bash
# Create .venv in the repo and install the project (editable) with its test extras.
# Idempotent: a stamp of the inputs' hash makes a second run a no-op in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
TORCH_PIN="torch==2.13.0"
STAMP="$VENV/.setup-stamp"
# constraints.txt: the exact versions the suite was run with (scripts/refresh-constraints.sh writes it).
CONSTRAINTS=constraints.txt
inputs_hash=$(cat pyproject.toml "$CONSTRAINTS" scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$inputs_hash" ]]; then
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first: an unpinned dependency would otherwise pull a multi-GB CUDA build.
# --no-compile, then one parallel compileall: pip compiles every file on one core, about a third of the setup.
"${PIP[@]}" install --no-compile -c "$CONSTRAINTS" "$TORCH_PIN"
"${PIP[@]}" install --no-compile -c "$CONSTRAINTS" -e ".[test]"
site_packages=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
# Files written for a newer Python (torch's py312 test helpers) do not compile; pip skips them silently too.
"$VENV/bin/python" -m compileall -qq -j 0 "$site_packages" || true
echo "$inputs_hash" > "$STAMP"
echo "setup: environment ready in $VENV"
