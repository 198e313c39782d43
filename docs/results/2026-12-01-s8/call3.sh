#!/bin/bash
# Session 8, call 3: gemm_persistent's tiles against cuBLAS on the shapes DecodeMatmul.linear
# leaves to cuBLAS (qkv, o_proj, down at prefill and 1024 rows; lm_head at 256 / 1024 rows),
# and 1.5b at 256 rows (gate/up included), before wiring persistent candidates into linear.
export PYTHONPATH=$PWD
B="timeout 170 python benchmarks/engine_gemm.py --persistent"
$B --out $OUT/a --models qwen2.5-0.5b --rows 1024,16384 --ops qkv,o_proj,down 2>&1 | grep "^|"
$B --out $OUT/b --models qwen2.5-0.5b,qwen2.5-1.5b --rows 256,1024 --ops lm_head 2>&1 | grep "^|"
$B --out $OUT/c --models qwen2.5-1.5b --rows 256,16384 --ops qkv,o_proj,gate_up,down 2>&1 | grep "^|"
for d in a b c; do python -c "
import json
for r in json.load(open('$OUT/$d/gemm_bench.json'))['results']:
    us = r['us']; best = sorted(us.items(), key=lambda kv: kv[1])[:4]
    print(r['model'], r['rows'], r['op'], 'cublas', round(us['cublas'], 1), best)"; done
