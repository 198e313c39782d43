#!/bin/bash
# Session 12 call6 (the budget's last ~270 s): shared_prefix.PDL, the row kernel and the
# prefix kernel linked by PDL so the prefix programs launch during the row kernel's last wave
# and ask L2 for their prefixes before they wait. Kernel GPU tests and the lean engine test;
# PDL off/on per layer; a short whole-generation A/B.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 100 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py -k "not generations or lean" -p no:cacheprovider 2>&1 | tail -2
timeout 45 python benchmarks/engine_prefix.py --pdl-only --out $OUT 2>&1 | grep -v -i warn
timeout 80 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --rounds 4 --a shared_prefix.PDL=False --b shared_prefix.PDL=True 2>&1 | grep -v -i warn | grep -v "attention tile"
