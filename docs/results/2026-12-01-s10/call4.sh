#!/bin/bash
# Session 10, call 4: three lean variants (which norms move: qkv+mlp, qkv, mlp), SiLU*up at
# 1024 pairs a program with the norm; parts again (engine_lean.py, with plain SiLU blocks),
# then the three cases end to end with the decode path chosen by timing.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 60 python -m pytest -q -m gpu tests/engine/test_lean.py -p no:cacheprovider 2>&1 | tail -2
timeout 100 python benchmarks/engine_lean.py --rounds 2 --json $OUT/lean.json 2>&1 | grep -v -i warn | grep -i "silu\|/"
for case in "qwen2.5-1.5b 256 r15" "qwen2.5-0.5b 1024 r1024" "qwen2.5-0.5b 256 r256"; do
  set -- $case
  eval timeout 100 $CLI bench rollout --preset $1 --prompts $2 --repeats 3 --no-hf --lean auto --json $OUT/$3.json 2>&1 | grep -v -i warn | grep "tok/s"
  python -c "
import json; d=json.load(open('$OUT/$3.json'))['engine']
print('$3', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'], {k: v for k, v in d['chain_timings_us'].items() if k.startswith('forward')})"
done
bash benchmarks/triton_cache.sh save $OUT
