#!/bin/bash
# The built-in calc task on a 2-core CPU host: SFT warm start on tool-use traces, then GRPO
# over two-turn calculator episodes. train-40-steps.log ran the example with
# trainer.total_steps=40 trainer.test_freq=20 data.val_batch_size=200
# data.builtin_val_size=200 sft.eval_every=25 sft.eval_size=64.
set -euo pipefail
hybridflow train --config examples/calc_tools.yaml trainer.run_dir="$OUT/run" 2>&1 | tee "$OUT/train.log"
