#!/bin/bash
# Asynchronous RL on one GPU (docs/performance.md): one NVIDIA H200, from the repository root.
# --prime 1 compiled the first step's graphs only: sync's step 2 compiled again (44.3 s), so
# the section reads the steady state from the later steps; --prime 2 avoids it.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/async_rl.py --steps 4 --warmup 1 --prime 1 --modes sync async:1:partial:priority \
    --run-timeout 260 --work-dir /tmp/work/async --json $OUT/async.json 2>&1 | tee $OUT/async.log
