#!/bin/bash
# Session 9, call 8 (the final engine code again, on another machine): the three
# cases through the CLI (HF in the same process for the 256-prompt cases).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 110 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 130 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'])"; done
