"""DeepSeek-V3 and GPT-OSS in the engine and the RL loop, both on the engine's own passes
(DeepSeek-V3 over its latent cache, GPT-OSS with a window's ring for its sliding layers):
greedy tokens are the model's own argmax and the routing record is what the model's routers
choose; a GRPO run with routing replay completes its steps."""

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.engine import Engine, SamplingParams
from hybridflow.models import load_model

PRESETS = ["tiny-deepseek-v3", "tiny-gpt-oss"]


def _greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_tokens_and_routes_are_the_models(preset):
    model = load_model(preset).eval()
    engine = Engine(model, max_batch_size=4, max_seq_len=32)
    assert engine.native
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # 5 + 6 tokens pass tiny-gpt-oss' window of 8
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    results = engine.generate(prompts, params)
    sparse = len(model.config.sparse_layer_indices())
    for prompt, completion in zip(prompts, results):
        assert completion.token_ids == _greedy_reference(model, prompt, 6)
        sequence = prompt + completion.token_ids
        trace = []
        with torch.no_grad():
            model(torch.tensor([sequence[:-1]]), router_trace=trace)
        expected = torch.stack([ids for _, ids in trace], dim=1)  # [T, L, k]
        record = completion.routed_experts
        assert record.shape == (len(sequence) - 1, sparse, model.config.num_experts_per_tok)
        assert torch.equal(torch.from_numpy(record).long(), expected)


# DeepSeek with LoRA: the merged weights the engine receives carry the router's
# score-correction buffer beside the parameters; GPT-OSS's merged experts keep their biases
@pytest.mark.parametrize("preset, extra", [
    ("tiny-deepseek-v3", ["model.lora_rank=4", "model.gradient_checkpointing=true"]),
    ("tiny-gpt-oss", ["model.lora_rank=4"]),
])  # fmt: skip
def test_grpo_with_routing_replay_completes_two_steps(tmp_path, preset, extra):
    from hybridflow.trainer.lifecycle.run import train

    cfg = load_config(None, [
        f"model.path={preset}", "data.train_batch_size=4", "data.builtin_train_size=16",
        "data.builtin_val_size=4", "data.max_response_length=6", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.device=cpu", "trainer.loggers=[jsonl]",
        "actor.router_replay=rollout", *extra,
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}",
    ])  # fmt: skip
    train(cfg, log=lambda *args, **kwargs: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 2


@pytest.mark.parametrize("preset", PRESETS)
def test_a_tensor_parallel_rollout_of_these_layers_validates(preset):
    """engine/tensor_parallel.py splits sink attention and MLA by heads (the experts split
    over the ranks, or held whole); what it does not build is still refused by key."""
    from hybridflow.config import ConfigError, validate

    four = [f"model.path={preset}", "trainer.backend=local", "trainer.n_gpus_per_node=4",
            "trainer.device=cpu", "rollout.tensor_parallel_size=2"]  # fmt: skip
    for extra in ([], ["rollout.expert_parallel_size=2"], ["rollout.expert_parallel_size=1"]):
        derived = validate(load_config(None, [*four, *extra]))
        assert derived.layouts.rollout.tp == 2
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, [*four, "rollout.engine.kv_cache_dtype=fp8",
                                    "rollout.engine.kv_block_size=16"]))  # fmt: skip
    assert error.value.problems == [
        "rollout.engine.kv_cache_dtype='fp8' does not cover a tensor-parallel rollout yet: set "
        "rollout.engine.kv_cache_dtype=model"]  # fmt: skip


def test_sequence_parallelism_of_sink_layers_is_refused_by_name():
    from hybridflow.config import ConfigError, validate

    cfg = load_config(None, ["model.path=tiny-gpt-oss", "actor.sequence_parallel_size=2",
                             "trainer.backend=local", "trainer.n_gpus_per_node=2",
                             "trainer.device=cpu"])  # fmt: skip
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert any("actor.sequence_parallel_size = 2: this model's 2 attention-sink layers" in p
               for p in error.value.problems), error.value.problems  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_expert_parallel_training_and_the_rollouts_experts_over_replicas_validate(preset):
    """The trainer splits both families' experts (models/sharding/expert_parallel.py), with
    LoRA on them; the rollout spreads them over several replicas (engine/expert_spread.py:
    GPT-OSS's biases with their experts), of one rank or tensor-parallel."""
    from hybridflow.config import validate

    two = ["trainer.backend=local", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
           f"model.path={preset}"]  # fmt: skip
    validate(load_config(None, [*two, "actor.expert_parallel_size=2", "model.lora_rank=4"]))
    validate(load_config(None, [*two, "rollout.expert_parallel_size=2"]))
    four = [*two[:1], "trainer.n_gpus_per_node=4", *two[2:], "rollout.tensor_parallel_size=2"]
    validate(load_config(None, [*four, "rollout.expert_parallel_size=4"]))
