#!/bin/bash
# Session 7, call 3 (final code): young objects collected while the host waits for the GPU,
# linear tuning reverted, a (128, 256, 64, 8, 4) gate/up tile candidate; the three
# cases through the CLI, a 1024-row timeline (GC pauses), then the GPU engine tests not run in
# calls 1-2 (test_engine's, test_chain, test_sampler_fused).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json > $OUT/cli.log 2>&1
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json >> $OUT/cli.log 2>&1
eval timeout 200 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json >> $OUT/cli.log 2>&1
grep -v -i warn $OUT/cli.log | grep -v "^ *_warn"
for f in r1024 r256 r15; do python -c "
import json,sys; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), d['runs_s'], d['chain_decisions'])
for k,v in d['matmul_timings_us'].items(): print('  ', k, v)"; done
timeout 100 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/timeline_1024.json > $OUT/timeline.txt 2>&1
grep -v -i warn $OUT/timeline.txt | grep -v "^USDT" | grep -v "^    " | head -20
timeout 200 python -m pytest -q -m gpu tests/engine/test_engine.py tests/engine/test_chain.py tests/engine/test_sampler_fused.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
