#!/bin/bash
# Session 7, call 1: timelines (prefill kernels, host syncs, pinned allocations, GC pauses)
# at 0.5b/1024 and 1.5b/256 with k rotated in place in prefill and GC paused through the
# results; the 1024 case through the CLI; then the GPU engine tests (first run of session 6's
# last commits on a GPU).
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 150 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/timeline_1024.json > $OUT/timeline.txt 2>&1
timeout 150 python benchmarks/engine_timeline.py --preset qwen2.5-1.5b --rows 256 --json $OUT/timeline_15.json >> $OUT/timeline.txt 2>&1
grep -v -i warn $OUT/timeline.txt | grep -v "^USDT"
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json > $OUT/cli.log 2>&1
grep -v -i warn $OUT/cli.log | grep -v "^ *_warn"
timeout 280 python -m pytest -q -m gpu tests/engine -x > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
