#!/bin/bash
# Session 9, call 3 (final code of the session so far: tuned store order, last layer on the
# last tokens in prefill, batched FusedProjections.refresh): the three cases through
# the CLI (HF in the same process for the 256-prompt cases), a 1024-row timeline (the call's
# start), and the engine's GPU tests.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 120 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 150 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], list(d['attention_tiles'].values()))"; done
timeout 90 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/timeline_1024.json > $OUT/timeline.txt 2>&1
grep -v -i warn $OUT/timeline.txt | grep -v "^USDT" | grep -v "^    " | head -12
timeout 130 python -m pytest -q -m gpu tests/engine/test_engine.py tests/engine/test_forward.py tests/engine/test_kernels.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
bash benchmarks/triton_cache.sh save $OUT
