#!/bin/bash
# End-to-end GRPO vs TRL (docs/performance.md): one NVIDIA H200, TRL installed, from the
# repository root. hybridflow and TRL each run in their own process on the same random-weight
# checkpoint, written at the first use of --model-dir.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/grpo_vs_trl.py --which both --model-dir /tmp/m05 \
    --json $OUT/qwen2.5-0.5b.json 2>&1 | tee $OUT/qwen2.5-0.5b.log
python benchmarks/grpo_vs_trl.py --which both --preset qwen2.5-1.5b --model-dir /tmp/m15 \
    --json $OUT/qwen2.5-1.5b.json 2>&1 | tee $OUT/qwen2.5-1.5b.log
