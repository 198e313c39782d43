"""The scheduler's step log (step_log.py): each step's kind, its decode rows and prompt
tokens live against computed (a decode chunk at its graph's batch bucket, a static mixed
step at its buckets), and the totals of its table. CPU, the torch backend; the static step
runs its host side over zero logits (what it pads does not depend on them)."""

from __future__ import annotations

import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling import step_log
from hybridflow.engine.scheduling.static_step import StaticMixedStep

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, ignore_eos=True)
EAGER = dict(decode_backend="torch", cuda_graphs=False, steps_per_sync=4, sync_lag=1)


def _logged(model, **options) -> Engine:
    engine = Engine(model, 8, 64, options=EngineOptions(**EAGER, **options))
    engine.start_generation()
    engine.scheduler.step_log = []
    return engine


def test_separate_passes_then_decode_chunks_at_their_batch_bucket(model):
    engine = _logged(model)
    engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]] + [[15, 16]], PARAMS)
    steps = engine.scheduler.step_log
    # one pass of 12 prompt tokens, then 5 tokens each in chunks of 4 and 1
    assert [(s.kind, s.forwards, s.rows, s.row_bucket, s.tokens) for s in steps] == [
        ("passes + decode", 4, 5, 8, 12), ("decode", 1, 5, 8, 0), ("read-back", 0, 0, 0, 0)]  # fmt: skip
    assert steps[0].first_tokens == 1 and not any(s.drains for s in steps)
    totals = step_log.summarize(steps)
    assert (totals["decode"].rows, totals["decode"].row_work) == (5, 8)
    assert (totals["passes + decode"].rows, totals["passes + decode"].row_work) == (20, 32)
    text = step_log.table(steps, layers=2)
    # live (25 rows + 12 tokens) x 2 layers against (40 + 12) x 2
    assert "work in tokens x layers: live 74, computed 104 (1.41x)" in text


def test_a_static_mixed_step_is_logged_at_its_buckets(model):
    engine = _logged(model, max_prefill_tokens_per_step=16, graph_mixed_steps=True)
    scheduler = engine.scheduler
    vocab = model.config.vocab_size

    def zeros(*args, **kwargs):  # [len(keep), V]: the host side runs, the model does not
        return torch.zeros(args[7].shape[0], vocab)

    scheduler.static_step = StaticMixedStep(engine, zeros)
    first = engine.submission([[5, 6, 7]] * 3, PARAMS)
    scheduler.add(first)
    scheduler.step()  # the three prompts alone
    scheduler.add(engine.submission([list(range(20, 40))], PARAMS))  # 20 tokens: 16 + 4
    scheduler.step()
    scheduler.step()
    kinds = [(s.kind, s.rows, s.row_bucket, s.tokens, s.token_bucket)
             for s in scheduler.step_log]  # fmt: skip
    # 3 rows at the bucket of 4, the chunks at the token buckets of 16 (16 and 4 tokens)
    assert kinds == [("prefill", 0, 0, 9, 9), ("mixed static", 3, 4, 16, 16),
                     ("mixed static", 3, 4, 4, 16)]  # fmt: skip
    assert scheduler.step_log[2].first_tokens == 1 and scheduler.static_step.steps == 2
