#!/bin/bash
# Multi-turn episodes through the rollout service against single-turn generate, one H200:
# the 0.5b with separate prefill/extend passes (budget 0) and with mixed steps of 2,048 prefill
# tokens, 3 fresh processes a side (the 1.5b file is the earlier separate-pass run); then where
# the 0.5b run's time goes on the engine's side.
set -euo pipefail
export PYTHONPATH=$PWD
for i in 1 2 3; do
  for budget in 0 2048; do
    hybridflow bench agent --preset qwen2.5-0.5b --episodes 256 --turns 4 --tool-latency-ms 10 --repeats 1 \
      --engine max_prefill_tokens_per_step=$budget --json "$OUT/agent-qwen2.5-0.5b-budget-$budget-$i.json"
  done
done
python3 dev/engine_ab.py --preset qwen2.5-0.5b --prompts 256 --rounds 6 \
  --a max_prefill_tokens_per_step=0 --b max_prefill_tokens_per_step=2048
python3 dev/agent_timeline.py --preset qwen2.5-0.5b
# A larger prefill budget (one process), and the time to first token of a 2,048-token request
# arriving into 255 decoding rows, mixed steps against separate passes.
hybridflow bench agent --preset qwen2.5-0.5b --episodes 256 --turns 4 --tool-latency-ms 10 --repeats 1 \
  --engine max_prefill_tokens_per_step=8192 --json "$OUT/agent-qwen2.5-0.5b-budget-8192-1.json"
for budget in 2048 0; do
  hybridflow bench ttft --engine max_prefill_tokens_per_step=$budget \
    --json "$OUT/ttft-qwen2.5-0.5b-budget-$budget.json"
done
