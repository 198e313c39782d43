#!/bin/bash
# Checkpoint save (docs/performance.md): a 2-core CPU host, from the repository root.
# Writes checkpoint.json (each run's save times by step) into $OUT; the table on stdout.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/checkpoint_save.py --presets qwen2.5-0.5b --device cpu --steps 3 \
  --json $OUT/checkpoint.json | tee $OUT/checkpoint.log
