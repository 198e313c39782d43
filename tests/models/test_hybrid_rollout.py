"""A hybrid model (Gated DeltaNet layers) in the engine and the RL loop: the engine runs it on
its own path (a recurrent state per slot beside the attention layer's K/V), whose greedy
tokens are the model's own argmax, as are its slow path's (the whole left-padded sequence
recomputed each step); a GRPO run on tiny-hybrid completes its steps."""

import torch

from hybridflow.config import load_config
from hybridflow.engine import Engine, SamplingParams
from hybridflow.models import load_model


def _greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_engine_runs_a_hybrid_model_natively_and_slowly_with_the_models_tokens():
    from hybridflow.engine.sampling import call_seeds
    from hybridflow.engine.slow import generate_slow

    model = load_model("tiny-hybrid").eval()
    model.init_weights(seed=1, std=0.2)  # tokens that change from step to step
    assert model.recurrent_layers == [0, 1, 2]
    engine = Engine(model, max_batch_size=4, max_seq_len=32)
    assert engine.native
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: the shorter is left-padded
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    native = engine.generate(prompts, params)
    slow = generate_slow(engine, prompts, params, call_seeds(len(prompts), params))
    for prompt, completion, recomputed in zip(prompts, native, slow):
        assert completion.token_ids == _greedy_reference(model, prompt, 6)
        assert recomputed.token_ids == completion.token_ids
    assert len(set(native[0].token_ids)) > 1


def test_grpo_on_tiny_hybrid_completes_two_steps(tmp_path):
    from hybridflow.trainer.lifecycle.run import train

    cfg = load_config(None, [
        "model.path=tiny-hybrid", "data.train_batch_size=4", "data.builtin_train_size=16",
        "data.builtin_val_size=4", "data.max_response_length=6", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.device=cpu", "trainer.loggers=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}",
    ])  # fmt: skip
    train(cfg, log=lambda *args, **kwargs: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 2
