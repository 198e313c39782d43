#!/bin/bash
# Multi-turn episodes through the rollout service against single-turn generate, one H200;
# then where the 0.5b run's time goes on the engine's side.
set -euo pipefail
export PYTHONPATH=$PWD
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
  hybridflow bench agent --preset "$preset" --episodes 256 --turns 4 --turn-tokens 64 \
    --tool-tokens 32 --tool-latency-ms 10 --json "$OUT/agent-kept-$preset.json"
done
python3 dev/agent_timeline.py --preset qwen2.5-0.5b
