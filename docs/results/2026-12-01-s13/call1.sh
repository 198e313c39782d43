#!/bin/bash
# Session 13 call1 (session 12 next_call.sh as written): the final code's numbers on a
# fresh machine, and what the shared-prefix attention's ~9-12 us of prefix work a layer is.
# 1. the issue's three cases with HF in the same process (their code is session 11's plus
#    this session's n > 1 changes, which n = 1 does not take), and a Triton cache to carry;
# 2. the CLI at n = 8 with HF, 0.5b and 1.5b;
# 3. engine_prefix.py --pdl-only (call6's timeout cut the 1.5b rows);
# 4. a GRPO-shaped timeline (0.5b, 512 rows = 64 prompts x 8, 256-token prompts): the prefix
#    kernel's and the SHARED row kernel's time per step inside a real call.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 120 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 150 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
bash benchmarks/triton_cache.sh save $OUT
eval timeout 100 $CLI bench rollout --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --repeats 3 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 150 $CLI bench rollout --preset qwen2.5-1.5b --prompts 64 --n 8 --prompt-len 256 --repeats 3 2>&1 | grep -v -i warn | grep "tok/s"
timeout 90 python benchmarks/engine_prefix.py --pdl-only --out $OUT 2>&1 | grep -v -i warn
timeout 90 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows 512 --n 8 --length 256 --json $OUT/timeline_n8.json 2>&1 | grep -v -i warn | head -30
