#!/bin/bash
# Rollout engine, shared-prefix attention (docs/performance.md): one NVIDIA H200, from the
# repository root. The engine_ab.py settings name the module switches of the measured commit.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
  python benchmarks/engine_ab.py --preset $preset --prompts 64 --n 8 --prompt-len 256 --rounds 6 \
      --a shared_prefix.MODE=off --b shared_prefix.MODE=auto
done
python benchmarks/engine_prefix.py --pdl-only --out $OUT  # writes engine_prefix.json
python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 512 --n 8 --length 256 \
    --json $OUT/timeline-qwen2.5-0.5b-64x8.json
