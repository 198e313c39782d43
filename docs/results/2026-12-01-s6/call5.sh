#!/bin/bash
# Session 6, call 5: the three cases through the CLI with the lagged host reads
# (engine.SYNC_LAG = 1, the default now), and the old loop (--sync-lag 0) for 0.5b as A/B.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json > $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --no-hf --sync-lag 0 --json $OUT/r256_lag0.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 3 --no-hf --json $OUT/r1024.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 3 --no-hf --sync-lag 0 --json $OUT/r1024_lag0.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json >> $OUT/final.log 2>&1
grep -v -i warn $OUT/final.log | grep -v "^ *_warn"
