"""The slow path (slow.py: models the cached passes do not run) takes the seeds of every kind
of call: one prompt, and a base seed per prompt (a server's requests)."""

from __future__ import annotations

from hybridflow.engine import Engine, SamplingParams
from hybridflow.engine.sampling import call_seeds
from hybridflow.engine.slow import generate_slow
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config


def test_the_slow_path_samples_one_prompt_and_seeds_per_prompt():
    model = build_model(preset_config("tiny-deepseek-v3"), seed=1).eval()
    engine = Engine(model, max_batch_size=2, max_seq_len=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=4, ignore_eos=True)

    def slow(prompts, seeds=None):
        return generate_slow(engine, prompts, params, call_seeds(len(prompts), params, seeds))

    alone = slow([[3, 4, 5]])
    assert len(alone[0].token_ids) == 3
    seeded = slow([[3, 4, 5], [6]], seeds=[7, 8])
    assert slow([[3, 4, 5]], seeds=[7])[0].token_ids == seeded[0].token_ids
