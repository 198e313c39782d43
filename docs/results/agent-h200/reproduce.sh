#!/bin/bash
# Multi-turn episodes through the agent path against single-turn generate, one H200.
set -euo pipefail
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
  hybridflow bench agent --preset "$preset" --episodes 256 --turns 4 --turn-tokens 64 \
    --tool-tokens 32 --tool-latency-ms 10 --json "$OUT/agent-$preset.json"
done
