#!/bin/bash
# Session 9, call 5: prompt tokens per prefill pass, 16384 (the default) vs 32768, alternated
# in separate processes on one machine. call4 (cProfile): each 16k-token pass costs ~17 ms of
# host time (Triton's Python launch path ~40-90 us a launch, ~800 launches per call) against
# ~21 ms of GPU work, so a slow host falls behind during admissions; a pass twice as long
# halves the launches per prompt token.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
for tokens in 16384 32768 16384 32768; do
  eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --prefill-tokens $tokens --json $OUT/r1024_$tokens.json 2>&1 | grep -v -i warn | grep "tok/s" | sed "s/^/$tokens /"
done
for tokens in 16384 32768; do
  eval timeout 60 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --no-hf --prefill-tokens $tokens --json $OUT/r256_$tokens.json 2>&1 | grep -v -i warn | grep "tok/s" | sed "s/^/$tokens /"
done
for f in $OUT/r*.json; do python -c "
import json; d=json.load(open('$f'))['engine']
print('$(basename $f)', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'])"; done
