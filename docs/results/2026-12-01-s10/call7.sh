#!/bin/bash
# Session 10, call 7 (final engine code: lean layers off by default, SiLU*up at 1024 pairs a
# program): the three cases through the CLI, HF in the same process for the
# 256-prompt cases; then GPU tests of the kernels touched this session.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 120 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 150 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'])"; done
timeout 60 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "silu or fast_engine or rope" -p no:cacheprovider 2>&1 | tail -2
