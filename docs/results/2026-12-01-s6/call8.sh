#!/bin/bash
# Session 6, call 8: the lagged host reads with a queue and early stops (continuous batching:
# 1024 prompts through 256 slots, lengths ~geometric with mean 128): a finished row's slot is
# refilled one chunk later with lag 1, so this is where lag could cost. Lag 1 vs lag 0.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
for lag in 1 0; do
  eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --max-batch-size 256 --mean-length 128 --repeats 3 --no-hf --sync-lag $lag --json $OUT/queue_lag$lag.json >> $OUT/final.log 2>&1
done
grep -v -i warn $OUT/final.log | grep -v "^ *_warn"
