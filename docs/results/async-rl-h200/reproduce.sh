#!/bin/bash
# Asynchronous RL on one GPU (docs/performance.md): one NVIDIA H200, from the repository root.
# The table's run came second on the machine, so Triton's and inductor's caches in the work
# directory were warm for both modes (a cold first step takes ~190 s).
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/async_rl.py --steps 4 --warmup 1 --modes sync async:1:partial \
    --work-dir .cache/async-work --json $OUT/async.json 2>&1 | tee $OUT/async.log
