#!/bin/bash
# FP8 rollout accuracy (docs/performance.md): one NVIDIA H200, from the repository root.
# Writes fp8acc.json (every run's initial and final accuracy, its correction metrics, the
# per-mode means and the verdict) into $OUT; the table and each run's progress on stdout.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/fp8_rollout_accuracy.py --seeds 1 2 3 --steps 20 --work-dir /tmp/work/fp8 \
  --json $OUT/fp8acc.json | tee $OUT/fp8acc.log
