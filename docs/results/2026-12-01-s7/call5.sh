#!/bin/bash
# Session 7, call 5: the bf16 engine-vs-trainer log-prob gap on qwen2.5-0.5b alone (call4's
# full `rollout.py --only check` ran past its 150 s timeout before printing anything).
export PYTHONPATH=$PWD
timeout 220 python - > $OUT/gap.txt 2>&1 <<'PY'
import sys, json, torch
sys.path.insert(0, "benchmarks")
from rollout import logprob_gap
from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.bench_cli import make_prompts
from hybridflow.models import load_model
model = load_model("qwen2.5-0.5b", dtype=torch.bfloat16, device=torch.device("cuda")).eval()
prompts = make_prompts(16, 64, model.config.vocab_size, 1)
params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=0, ignore_eos=True)
engine = Engine(model, max_batch_size=32, max_seq_len=128)
print("qwen0.5b_bf16_fast_vs_trainer", json.dumps(logprob_gap(model, engine, prompts, params)), flush=True)
PY
grep -v -i warn $OUT/gap.txt | tail -5
