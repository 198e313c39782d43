#!/bin/bash
# Session 10, call 3: the lean layers' parts one kernel at a time (benchmarks/engine_lean.py:
# attention with 1/rms in front of the loop or on each tile's scores, SiLU*up with 1/rms at
# several block sizes, addmm_ vs linear), then end to end with NORM_IN_LOOP on.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 60 python -m pytest -q -m gpu tests/engine/test_lean.py -p no:cacheprovider 2>&1 | tail -2
timeout 150 python benchmarks/engine_lean.py --json $OUT/lean.json 2>&1 | grep -v -i warn
for case in "qwen2.5-1.5b 256 r15" "qwen2.5-0.5b 1024 r1024"; do
  set -- $case
  eval timeout 100 $CLI bench rollout --preset $1 --prompts $2 --repeats 3 --no-hf --lean auto --norm-in-loop on --json $OUT/$3.json 2>&1 | grep -v -i warn | grep "tok/s"
  python -c "
import json; d=json.load(open('$OUT/$3.json'))['engine']
print('$3', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'], {k: v for k, v in d['chain_timings_us'].items() if k.startswith('forward')})"
done
bash benchmarks/triton_cache.sh save $OUT
