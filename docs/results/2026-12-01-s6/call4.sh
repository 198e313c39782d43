#!/bin/bash
# Session 6, call 4: the lagged-snapshot GPU test alone (call3's test run hit its timeout
# after 8 passes), then engine_timeline.py with GC pauses and the host op at each large gap.
export PYTHONPATH=$PWD
timeout 240 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "lagged" --durations=3 > $OUT/tests.txt 2>&1
for case in "qwen2.5-0.5b 256 1" "qwen2.5-0.5b 1024 1" "qwen2.5-0.5b 256 1"; do
  set -- $case
  timeout 150 python benchmarks/engine_timeline.py --preset $1 --rows $2 --lag $3 --json $OUT/timeline_$2_lag$3_$RANDOM.json >> $OUT/timeline.txt 2>&1
done
tail -6 $OUT/tests.txt; grep -v Warn $OUT/timeline.txt
