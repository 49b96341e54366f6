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

# Three pytest sessions side by side on the 2 cores: the multi-process and services tests in two halves
# (tests/conftest.py's --launch-shard: at most two launches of training processes at a time, each half one
# user of its local services: etcd is Bamboo's, moto and the Lambda endpoint Dorylus's), and the in-process
# tests beside them. The launches spend about 40% of their time waiting (a failover noticed, a process
# started), which the others fill. Exit status 5 (no test selected, e.g. a file of one kind passed as an
# argument) counts as success unless every session selected nothing. TEST_SPLIT=0 (or a -m selection of the
# caller's): one session. Each session lists its slowest tests (--durations): where the suite's time goes,
# in every CI log.
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
rest_log="$services_dir/launch-rest.log"
set +e
"$PY" -m pytest -m "not multiprocess and not services" --durations=15 "$@" >"$inproc_log" 2>&1 &
inproc_pid=$!
pids+=("$inproc_pid")
"$PY" -m pytest -m "multiprocess or services" --launch-shard rest --durations=25 "$@" >"$rest_log" 2>&1 &
rest_pid=$!
pids+=("$rest_pid")
"$PY" -m pytest -m "multiprocess or services" --launch-shard bamboo --durations=25 "$@"
rc_bamboo=$?
wait "$rest_pid"
rc_rest=$?
wait "$inproc_pid"
rc_inproc=$?
set -e
echo "=== multi-process tests, the other half (the session that ran beside the one above) ==="
cat "$rest_log"
echo "=== in-process tests (the session that ran beside the ones above) ==="
cat "$inproc_log"
echo "test.sh: launch tests exit $rc_bamboo (Bamboo half) and $rc_rest (the rest), in-process tests exit $rc_inproc"
if [[ $rc_bamboo == 5 && $rc_rest == 5 && $rc_inproc == 5 ]]; then exit 5; fi
for rc in $rc_bamboo $rc_rest $rc_inproc; do
    if [[ $rc != 0 && $rc != 5 ]]; then exit "$rc"; fi
done
exit 0
