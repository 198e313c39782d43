#!/bin/bash
# The current engine against the code before EngineOptions (6236519), both in one process,
# calls interleaved; then the GPU tests. From the repository root, OUT set, one H200.
set -euo pipefail
export PYTHONPATH=$PWD
git worktree add /tmp/before 6236519
for workload in "qwen2.5-0.5b 256 8" "qwen2.5-1.5b 256 8" "qwen2.5-0.5b 1024 6"; do
  set -- $workload
  python3 dev/engine_ab.py --preset "$1" --prompts "$2" --rounds "$3" --a-tree /tmp/before \
    --json "$OUT/ab-$1-$2.json"
done
python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 200 -rfE --durations=25 tests \
  > "$OUT/pytest-gpu.txt" 2>&1
