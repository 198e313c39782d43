#!/bin/bash
# The request-level scheduler against the closed-batch one (a606953), both in one process,
# calls interleaved; then the GPU tests. From the repository root, OUT set, one H200.
set -euo pipefail
export PYTHONPATH=$PWD
mkdir -p .ab/before && git archive a606953 hybridflow | tar -x -C .ab/before
for workload in "qwen2.5-0.5b 256 8" "qwen2.5-0.5b 1024 6" "qwen2.5-1.5b 256 6"; do
  set -- $workload
  python3 dev/engine_ab.py --preset "$1" --prompts "$2" --rounds "$3" --a-tree .ab/before \
    --json "$OUT/ab-$1-$2.json"
done
python3 -m pytest -m gpu -q -p no:cacheprovider tests
