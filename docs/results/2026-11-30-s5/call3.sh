#!/bin/bash
# Session 5, call 3: gemm_nt tiles through TMA tensor descriptors (gemm.TMA) A/B: GPU tests,
# lm_head/gate_up tile timings, end-to-end variants (TMA off/on for the three cases).
export PYTHONPATH=$PWD
timeout 150 python -m pytest -q -m gpu tests/engine/test_kernels.py tests/engine/test_chain.py -k "tma or gemm or fast_engine or pdl or chain or matmul" > $OUT/tests.txt 2>&1
timeout 330 python benchmarks/rollout.py --out $OUT/var --only variants > $OUT/variants.txt 2>&1
timeout 90 python benchmarks/engine_gemm.py --out $OUT --models qwen2.5-0.5b --rows 256 --ops gate_up,lm_head --quick > $OUT/gemm.txt 2>&1
tail -3 $OUT/tests.txt; grep "|" $OUT/variants.txt | tail -10; grep "chain" $OUT/variants.txt | cut -c1-1500; tail -4 $OUT/gemm.txt
