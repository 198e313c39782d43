#!/bin/bash
# Session 6, call 7 (final numbers, code as committed): lagged host reads, GC paused inside
# generate(); the three cases through the CLI, then a timeline at 1024 rows.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json > $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json >> $OUT/final.log 2>&1
grep -v -i warn $OUT/final.log | grep -v "^ *_warn"
timeout 120 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/timeline_1024.json > $OUT/timeline.txt 2>&1
grep -v -i warn $OUT/timeline.txt | head -12
