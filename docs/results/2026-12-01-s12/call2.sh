#!/bin/bash
# Session 12 call2: shared-prefix attention, now on. GPU tests of the new group sizes; the
# prefix program's tile and group size swept against the plain kernel (engine_prefix.py);
# the bf16 gap per decode path with and without it; groups of 16 vs 8 at n = 16; the CLI
# at n = 8 with HF in the same run.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 100 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py -k "other_group" -p no:cacheprovider 2>&1 | tail -2
timeout 120 python benchmarks/engine_prefix.py --out $OUT 2>&1 | grep -v -i warn
timeout 90 python benchmarks/rollout.py --only gap --out $OUT 2>&1 | grep "^check"
timeout 100 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 32 --n 16 --prompt-len 256 --rounds 6 --a shared_prefix.GROUP_ROWS=8 --b shared_prefix.GROUP_ROWS=16 2>&1 | grep -v -i warn | grep -v "attention tile"
timeout 150 python -c 'import sys; from hybridflow.cli import main; sys.exit(main())' bench rollout --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --new-tokens 256 --repeats 3 --json $OUT/cli_n8.json 2>&1 | grep -v -i warn | tail -12
