#!/bin/bash
# Session 11, call 5 (final code): the three cases with HF in the same process, the
# bf16 log-prob gap through each decode path, refresh timing, the start of a 0.5b/256 call,
# GPU tests (the fold kernel, fast vs eager engine, stop tokens through lagged snapshots).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 120 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 150 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'])"; done
bash benchmarks/triton_cache.sh save $OUT
timeout 120 python benchmarks/rollout.py --out $OUT/gap --only gap 2>&1 | grep "^check"
timeout 50 python benchmarks/engine_refresh.py 2>&1 | grep -v -i warn
timeout 50 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 256 2>&1 | grep -v -i warn | grep -A14 "before the first admission"
timeout 150 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "fold or fast_engine or lagged" -p no:cacheprovider 2>&1 | tail -3
