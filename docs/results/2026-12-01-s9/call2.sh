#!/bin/bash
# Session 9, call 2: the tuned store order (STORE_LAST None) and the last-layer prefill on
# the last tokens only. GPU tests of both, 0.5b/1024 with the store order tuned vs forced off
# (two processes, same machine), a 1024-row timeline (where the call's time goes now), and
# the Triton cache saved again (new kernel variants).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 120 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "rope_equals or bf16_prefill or store_orders" -p no:cacheprovider 2>&1 | tail -2
for mode in tune off tune; do
  eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --store-last $mode --json $OUT/r1024_$mode.json 2>&1 | grep -v -i warn | grep "tok/s"
done
python -c "
import json; d=json.load(open('$OUT/r1024_tune.json'))['engine']; print(d['runs_s'], d['attention_tiles'])"
timeout 100 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/timeline_1024.json > $OUT/timeline.txt 2>&1
grep -v -i warn $OUT/timeline.txt | grep -v "^USDT" | head -60
bash benchmarks/triton_cache.sh save $OUT
