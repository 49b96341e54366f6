#!/bin/bash
# Issue 31's measurements on a lent device machine (16 cores, one GPU), in one prepared call:
#
#   bash benchmarks/device_dorylus.sh diagnose   # where a 2- and 4-server pipeline waits (--profile)
#   bash benchmarks/device_dorylus.sh NODES=20000 diagnose   # the same at a size this 2-core machine runs
#
# Each configuration's whole output goes to $OUT/<name>.log (the device tool brings $OUT back); this prints
# the last line of each. pymetis travels as a wheel in .whl/ (see /work/.library/device/README.md); the
# device's own torch, Lightning and PyG are used. Nothing here is a test: the figures go to
# docs/dorylus-pipeline-benchmark.md with the machine that gave them.
set -u
for arg in "$@"; do case $arg in *=*) export "${arg?}" ;; *) phase=$arg ;; esac; done
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
nodes=${NODES:-500000}
if [ -z "${PYTHON:-}" ] && ls .whl/pymetis-*.whl >/dev/null 2>&1; then  # the device: its python3 lacks pymetis
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/pymetis-*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
echo "cores $(nproc) load $(cut -d' ' -f1-3 /proc/loadavg)"
$py -c "import torch, lightning, torch_geometric, numpy; print('torch', torch.__version__, 'lightning', \
lightning.__version__, 'pyg', torch_geometric.__version__, 'numpy', numpy.__version__, \
'cuda', torch.cuda.is_available())"

run() {  # run NAME [VAR=VALUE ...] COMMAND ...: one configuration, its log in $out/NAME.log
    local name=$1
    shift
    echo "== $name: $* ($(date +%T))"
    timeout "${LIMIT:-240}" env "$@" >"$out/$name.log" 2>&1
    echo "rc=$? ($(date +%T)): $(grep -E '^(cores|own-cores bound)' "$out/$name.log" | tr '\n' ' ')"
    tail -n 1 "$out/$name.log"
}

pipeline="$py benchmarks/dorylus_pipeline.py --nodes $nodes --epochs 2 --warmup 1 --profile --cache-dir /tmp/dc"
case ${phase:-diagnose} in
diagnose)
    # The setting (one executor worker per server), then workers for every worker core, then
    # OpenMP threads that sleep rather than spin while a server's main thread is in Python.
    run s2_w1 $pipeline --servers 2 --executor-workers 1
    run s2_w4 $pipeline --servers 2 --executor-workers 4
    run s2_w4_passive OMP_WAIT_POLICY=PASSIVE $pipeline --servers 2 --executor-workers 4
    [ "${FOUR:-0}" = 1 ] && run s4_w2_passive OMP_WAIT_POLICY=PASSIVE $pipeline --servers 4 --executor-workers 2
    ;;
final)
    # CUDA: one graph server on the GPU against one on the CPU (Cora, the recipe, 200 epochs); then four
    # servers with the benchmark's defaults (two workers each, passive OpenMP threads).
    if [ -z "${PYTHON:-}" ]; then  # the recipes' omegaconf/hydra (antlr4 is an sdist)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/omegaconf-*.whl .whl/hydra_core-*.whl || exit 1
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
            .whl/antlr4-python3-runtime-*.tar.gz || exit 1
    fi
    cora="$py tests/dorylus/scripts/cora_run.py"
    run cora_gpu $cora /tmp/cora_gpu ++trainer.accelerator=gpu trainer.devices=1 --model gcn --seeds 1
    run cora_cpu $cora /tmp/cora_cpu ++trainer.accelerator=cpu trainer.devices=1 --model gcn --seeds 1
    run s4 $pipeline --servers 4
    ;;
*)
    echo "unknown phase ${phase}" >&2
    exit 2
    ;;
esac
