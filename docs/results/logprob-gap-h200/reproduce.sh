#!/bin/bash
# Log-prob gap (bf16) (docs/performance.md): one NVIDIA H200, from the repository root.
# Writes rollout.json (the gap per decode path) into $OUT.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/rollout.py --only gap --out $OUT
