#!/usr/bin/env bash
# Lint, start the local services the tests need (loopback only), run the suite, stop what we started.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

.venv/bin/ruff check .

pids=()
services_dir=$(mktemp -d -t lbd-services-XXXXXX)
cleanup() {
    for pid in "${pids[@]:-}"; do [[ -n "$pid" ]] && kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]:-}"; do [[ -n "$pid" ]] && timeout 10 tail --pid="$pid" -f /dev/null 2>/dev/null || true; done
    rm -rf "$services_dir"
}
trap cleanup EXIT

if [[ -f scripts/services.sh ]]; then
    # services.sh prints "NAME=VALUE" lines for the environment and "PID=<pid>" for each server.
    while IFS='=' read -r key value; do
        if [[ "$key" == PID ]]; then pids+=("$value"); else export "$key=$value"; fi
    done < <(DORYLUS_SERVICES_DIR="$services_dir" bash scripts/services.sh)
fi

# 2 pytest-xdist workers: the multi-process and services tests run one at a time on one worker (the group
# "serial", tests/conftest.py), the single-process tests beside them on the other. PYTEST_WORKERS=0: serial.
workers=${PYTEST_WORKERS:-2}
parallel=()
if [[ "$workers" -gt 1 ]]; then parallel=(-n "$workers" --dist loadgroup); fi

set +e
"$PY" -m pytest "${parallel[@]}" "$@"
rc=$?
set -e
exit $rc
