#!/bin/sh
# docs/performance.md, "Weight sync into a tensor-parallel rollout": from the repository root,
# OUT set to a directory for the files it writes.
set -e
PYTHONPATH=. python benchmarks/weight_sync.py --model qwen2.5-0.5b --world 2 --rollout-tp 2 --repeats 3 > "$OUT/world2.txt"
PYTHONPATH=. python benchmarks/weight_sync.py --model qwen2.5-0.5b --world 4 --train-tp 2 --rollout-tp 2 --repeats 3 > "$OUT/world4-train-tp2.txt"
