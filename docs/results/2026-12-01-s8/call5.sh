#!/bin/bash
# Session 8, call 5 (code with the persistent gate/up): the three cases through the
# CLI (HF in the same process for the 256-prompt cases), the chain's GPU tests (its launch
# lost TAIL's arguments), and the attention tiles at a call's first, mean and last lengths.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 110 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 130 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), d['ttft_s'], d['runs_s'], d['chain_decisions'], d['attention_tiles'])"; done
timeout 90 python benchmarks/engine_attention.py --out $OUT/attn > $OUT/attn.txt 2>&1; grep -v -i warn $OUT/attn.txt | tail -30
timeout 150 python -m pytest -q -m gpu tests/engine/test_chain.py -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
