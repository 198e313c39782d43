#!/bin/bash
# Big models on one GPU, 16k-token training (docs/performance.md): one NVIDIA H200, from the
# repository root.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/long_sequence_train.py --steps 2 --prompt-len 8192 --new-tokens 8192 \
    --json $OUT/long16k.json 2>&1 | tee $OUT/long16k.log
