#!/bin/bash
# Session 11, call 2: new defaults (lean.MODE auto; graphs.TUNE_AT_MIDDLE: the capture's
# warm-up, where the attention tile is tuned, runs at mid-generation lengths). The three
# cases without HF; the attention tiles timed at a call's first/middle/last lengths; a 1.5b
# timeline (attention time in the call; host ops before the first admission); GPU tests.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 100 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --no-hf --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 60 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --no-hf --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r15 r1024 r256; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'])
for k, v in d['attention_tiles'].items(): print('   tile', v, 'NORM' if ', True, \'torch' in k.split('256, ')[-1][:8] else '')"; done
timeout 100 python benchmarks/engine_timeline.py --preset qwen2.5-1.5b --rows 256 --json $OUT/timeline15.json 2>&1 | grep -v -i warn | grep -v "^  gap" | head -60
timeout 150 python benchmarks/engine_attention.py --by-length --out $OUT 2>&1 | grep -v -i warn
bash benchmarks/triton_cache.sh save $OUT
timeout 140 python -m pytest -q -m gpu tests/engine/test_kernels.py tests/engine/test_lean.py -k "fast_engine or lean or pdl or lagged" -p no:cacheprovider 2>&1 | tail -3
ls $OUT
