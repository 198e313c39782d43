#!/bin/bash
# Session 10, call 1: the lean decode layers (engine/lean.py: cuBLAS matmuls, the RMSNorms
# inside attention and SiLU*up, residual adds inside cuBLAS) timed against split and chain
# per bucket (chain_timings_us "forward(...)"), GPU tests, and session 9's unrun stream-K v2.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 60 python -m pytest -q -m gpu tests/engine/test_lean.py -p no:cacheprovider 2>&1 | tail -2
for case in "qwen2.5-1.5b 256 r15" "qwen2.5-0.5b 1024 r1024" "qwen2.5-0.5b 256 r256"; do
  set -- $case
  eval timeout 110 $CLI bench rollout --preset $1 --prompts $2 --repeats 3 --no-hf --lean auto --json $OUT/$3.json 2>&1 | grep -v -i warn | grep "tok/s"
  python -c "
import json; d=json.load(open('$OUT/$3.json'))['engine']
print('$3', round(d['tokens_per_s']), round(d['ttft_s'] * 1e3, 1), d['runs_s'], d['chain_decisions'], {k: v for k, v in d['chain_timings_us'].items() if k.startswith('forward')})"
done
timeout 50 python -m pytest -q -m gpu tests/engine/test_gemm.py -k "streamk" -p no:cacheprovider 2>&1 | tail -2
timeout 60 python benchmarks/engine_streamk.py --json $OUT/streamk.json 2>&1 | grep -v -i warn
bash benchmarks/triton_cache.sh save $OUT
