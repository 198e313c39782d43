#!/bin/bash
# Session 12 call3: the prefix program split along the prefix (shared_prefix.PREFIX_SPLITS,
# shares parked and merged by the last to arrive). GPU tests; the sweep of tiles x splits;
# whole generations with splits 1 vs auto at 0.5b and 1.5b, 64 prompts x n = 8.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 170 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py -k "split or engine or group" -p no:cacheprovider 2>&1 | tail -2
timeout 130 python benchmarks/engine_prefix.py --out $OUT 2>&1 | grep -v -i warn
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
timeout 110 python benchmarks/engine_ab.py --preset $preset --prompts 64 --n 8 --prompt-len 256 --rounds 6 --a shared_prefix.PREFIX_SPLITS=1 --b shared_prefix.PREFIX_SPLITS=None 2>&1 | grep -v -i warn | grep -v "attention tile"
done
