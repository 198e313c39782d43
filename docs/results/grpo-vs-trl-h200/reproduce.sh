#!/bin/bash
# End-to-end GRPO vs TRL (docs/performance.md): one NVIDIA H200, TRL installed, from the
# repository root. Each side runs in its own process on the same checkpoint (/tmp/m05).
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/grpo_vs_trl.py --which hybridflow --model-dir /tmp/m05 --json $OUT/hybridflow.json 2>&1 | tee $OUT/hybridflow.log
python benchmarks/grpo_vs_trl.py --which trl --model-dir /tmp/m05 --json $OUT/trl.json 2>&1 | tee $OUT/trl.log
python benchmarks/grpo_vs_trl.py --which hybridflow --model-dir /tmp/m05 --override model.compile=true \
    --json $OUT/hybridflow-compile.json 2>&1 | tee $OUT/hybridflow-compile.log
