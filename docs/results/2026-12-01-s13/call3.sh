#!/bin/bash
# Session 13 call3: where a 1.5b/256 call's time goes on the final code (the one case short of
# its bar), and the same for 0.5b/256, for the closing analysis of #9.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 150 python benchmarks/engine_timeline.py --preset qwen2.5-1.5b --rows 256 --json $OUT/timeline_15b.json 2>&1 | grep -v -i warn | head -60
timeout 100 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 256 --json $OUT/timeline_05b.json 2>&1 | grep -v -i warn | head -60
