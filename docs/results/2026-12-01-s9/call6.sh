#!/bin/bash
# Session 9, call 6: can attention run under matmuls? Two half batches on two streams, the
# second offset by the first's first attention (benchmarks/engine_overlap.py), at 0.5b/1024
# and 0.5b/256; decode layers only, graph replays.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 150 python benchmarks/engine_overlap.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/overlap_1024.json 2>&1 | grep -v -i warn | tail -7
timeout 120 python benchmarks/engine_overlap.py --preset qwen2.5-0.5b --rows 256 --json $OUT/overlap_256.json 2>&1 | grep -v -i warn | tail -7
