#!/bin/bash
# Session 6, call 3: GPU tests of the lagged host reads (and the engine paths they touch),
# then where generate()'s wall time goes (engine_timeline.py: GPU idle gaps by host phase)
# with the old loop (lag 0) and the new one (lag 1).
export PYTHONPATH=$PWD
timeout 200 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "lagged or fast_engine or pdl" > $OUT/tests.txt 2>&1
for case in "qwen2.5-0.5b 1024 0" "qwen2.5-0.5b 1024 1" "qwen2.5-0.5b 256 0" "qwen2.5-0.5b 256 1"; do
  set -- $case
  timeout 150 python benchmarks/engine_timeline.py --preset $1 --rows $2 --lag $3 --json $OUT/timeline_$2_lag$3.json >> $OUT/timeline.txt 2>&1
done
tail -3 $OUT/tests.txt; grep -v Warn $OUT/timeline.txt
