"""Pinned timing choices across processes (GPU): two processes started one after the other
with the same model, options and cache directory make the same kernel choices (the second
one times nothing) and draw identical tokens from the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from hybridflow.engine import Engine, EngineOptions, SamplingParams
    from hybridflow.bench.common import make_prompts
    from hybridflow.engine.kernels import attention
    from hybridflow.models import load_model

    cache_dir, out, retune = sys.argv[1], sys.argv[2], sys.argv[3] == "retune"
    model = load_model("qwen2.5-0.5b", dtype=torch.bfloat16, device="cuda").eval()
    # 40 prompts x 2 samples: 80 rows, then fewer as the early-stopping ones finish, so several
    # batch buckets are timed (decode layer, attention tile, gate/up kernel each)
    prompts = make_prompts(40, 24, model.config.vocab_size, 0)
    stops = list(range(100, 100 + model.config.vocab_size // 24))
    options = EngineOptions(cache_dir=cache_dir, retune=retune)
    engine = Engine(model, max_batch_size=80, max_seq_len=96, options=options)
    params = SamplingParams(n=2, max_new_tokens=64, seed=7, stop_token_ids=stops)
    completions = engine.generate(prompts, params)
    json.dump({
        "tokens": [c.token_ids for c in completions],
        "logprobs": [c.logprobs for c in completions],
        "choices": engine.pinned_choices()["choices"],
        "timed": {"layers": engine.chooser.timings, "chain": engine.chain.timings,
                  "matmul": {str(k): v for k, v in engine.matmul.timings.items()},
                  "attention": hasattr(attention._decode_attention_tuned, "bench_time")},
    }, open(out, "w"))
    """
)


def _run(cache_dir: Path, out: Path, retune: bool = False) -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir), str(out), "retune" if retune else "-"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_second_process_reuses_the_choices_and_draws_the_same_tokens(tmp_path):
    first = _run(tmp_path / "cache", tmp_path / "first.json")
    assert first["timed"]["layers"] and first["timed"]["attention"]  # the first one timed
    kinds = {name.split(":")[0] for name in first["choices"]}
    assert {"decode_layer", "attention", "gate_up"} <= kinds
    files = list((tmp_path / "cache" / "engine-choices").glob("*.json"))
    assert len(files) == 1
    second = _run(tmp_path / "cache", tmp_path / "second.json")
    assert second["choices"] == first["choices"]
    assert second["timed"] == {"layers": {}, "chain": {}, "matmul": {}, "attention": False}
    assert second["tokens"] == first["tokens"]
    assert second["logprobs"] == first["logprobs"]
    # retune times again (and may choose otherwise); the file then holds the new choices
    third = _run(tmp_path / "cache", tmp_path / "third.json", retune=True)
    assert third["timed"]["layers"]
    saved = json.loads(files[0].read_text())["choices"]
    assert saved == third["choices"]
