#!/bin/bash
# The built-in calc task on a 2-core CPU host: SFT warm start on tool-use traces, then GRPO
# over two-turn calculator episodes. train.log: this script from a fresh clone with an empty
# HOME (so the warm start trains), docs/agents.md says the host and commit.
set -euo pipefail
hybridflow train --config examples/calc_tools.yaml trainer.run_dir="$OUT/run" 2>&1 | tee "$OUT/train.log"
