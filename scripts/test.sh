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

# Two pytest sessions side by side on the 2 cores: the multi-process and services tests one after another
# (at most one launch of training processes at a time; one user of the local services at a time), and the
# in-process tests (one core) beside them, filling the launches' idle time. Exit status 5 (no test selected,
# e.g. a file of one kind passed as an argument) counts as success unless both sessions selected nothing.
# TEST_SPLIT=0 (or a -m selection of the caller's): one session. Each session lists its slowest tests
# (--durations): where the suite's time goes, in every CI log.
split=${TEST_SPLIT:-1}
for arg in "$@"; do
    if [[ "$arg" == -m* ]]; then split=0; fi  # the caller selects by marker: one session, theirs
done
if [[ "$split" == 0 ]]; then
    set +e
    "$PY" -m pytest "$@"
    rc=$?
    set -e
    exit $rc
fi
inproc_log="$services_dir/inprocess.log"
set +e
"$PY" -m pytest -m "not multiprocess and not services" --durations=15 "$@" >"$inproc_log" 2>&1 &
inproc_pid=$!
pids+=("$inproc_pid")
"$PY" -m pytest -m "multiprocess or services" --durations=40 "$@"
rc_launch=$?
wait "$inproc_pid"
rc_inproc=$?
set -e
echo "=== in-process tests (the session that ran beside the one above) ==="
cat "$inproc_log"
echo "test.sh: launch tests exit $rc_launch, in-process tests exit $rc_inproc"
if [[ $rc_launch == 5 && $rc_inproc == 5 ]]; then exit 5; fi
for rc in $rc_launch $rc_inproc; do
    if [[ $rc != 0 && $rc != 5 ]]; then exit "$rc"; fi
done
exit 0
