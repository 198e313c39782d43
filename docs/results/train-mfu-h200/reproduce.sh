#!/bin/bash
# Training throughput (MFU) (docs/performance.md): one NVIDIA H200, from the repository root.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/train_throughput.py --steps 4 --warmup 2 --attention-backends flash_varlen \
    --variants ours,ours-compile,hf-ckpt --time-budget 110 --json $OUT/mfu.json 2>&1 | tee $OUT/mfu.log
