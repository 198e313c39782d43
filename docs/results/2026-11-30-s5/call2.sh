#!/bin/bash
# Session 5, call 2: KV cache layout (token- vs head-major) A/B: attention kernel, step anatomy
# at the mean cache length, end-to-end variants.
export PYTHONPATH=$PWD
timeout 90 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "layout or fast_engine" > $OUT/tests.txt 2>&1
timeout 170 python benchmarks/engine_attention.py --out $OUT > $OUT/attention.txt 2>&1
timeout 280 python benchmarks/rollout.py --out $OUT/var --only variants > $OUT/variants.txt 2>&1
for c in "qwen2.5-0.5b 256 token" "qwen2.5-0.5b 256 head"; do set -- $c
  timeout 45 python benchmarks/engine_step.py --preset $1 --rows $2 --kv-layout $3 --json $OUT/step_$1_$2_$3.json >> $OUT/step.txt 2>&1
done
tail -3 $OUT/tests.txt; grep -v "^  best\|^BEST" $OUT/attention.txt | tail -3; grep "major\|BEST" $OUT/attention.txt; tail -12 $OUT/variants.txt; cat $OUT/step.txt
