#!/bin/bash
# Session 11, call 7 (staged feature, off by default): shared-prefix decode attention on the
# GPU: its tests, then n = 8 rollouts (64 prompts x 256 tokens, 256 new) with it off vs on,
# both in one process, calls interleaved.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 90 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py -p no:cacheprovider 2>&1 | tail -3
timeout 90 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --rounds 4 --a shared_prefix.MODE=off --b shared_prefix.MODE=auto 2>&1 | grep -v -i warn
