#!/bin/bash
# examples/gsm8k.yaml's step (docs/performance.md, End-to-end GRPO vs TRL): one NVIDIA H200,
# from the repository root, GSM8K's train.jsonl at $GSM8K.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/gsm8k_step.py --input ${GSM8K:?the GSM8K train.jsonl} --steps 3 --work-dir /tmp/work/gsm8k \
    --json $OUT/gsm8k.json 2>&1 | tee $OUT/gsm8k.log
