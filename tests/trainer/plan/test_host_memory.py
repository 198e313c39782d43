"""Host memory is planned before any model loads: a step's data on the controller (and a
CPU run's model) against the memory free on the machine."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.plan import host_memory
from hybridflow.trainer.plan.host_memory import HostNeed, check_host_memory, host_need, sample_bytes


def test_sample_bytes_by_hand():
    # 10 prompt tokens: 3 int64 each = 240; 5 response tokens: 3 int64 (24) + 8 float32 (32)
    # + 1 text byte = 57 each = 285; 100 bytes of arrays
    assert sample_bytes(10, 5, reference=False, critic=False) == 240 + 285 + 100
    # the reference's log-probs and the critic's values: one float32 more each per token
    assert sample_bytes(10, 5, reference=True, critic=True) == 240 + 285 + 100 + 2 * 4 * 5


def test_the_step_counts_train_batch_size_times_n():
    cfg = load_config(
        None,
        [
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            "rollout.n=4",
            "data.val_files=[]",
        ],
    )
    need = host_need(cfg, validate(cfg))
    assert need.samples == 32 and "data.train_batch_size = 8 × rollout.n = 4" in need.what
    per_sample = sample_bytes(cfg.data.max_prompt_length, cfg.data.max_response_length,
                              validate(cfg).use_reference, validate(cfg).use_critic)  # fmt: skip
    assert need.data_bytes == 32 * per_sample


def test_a_validation_pass_larger_than_a_step_is_named():
    cfg = load_config(None, ["data.val_batch_size=100", "rollout.val_n=50", "rollout.n=2"])
    need = host_need(cfg, validate(cfg))
    assert need.samples == 5000 and "rollout.val_n = 50" in need.what


def test_a_hundred_million_samples_are_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (16 * 2**30, "test"))
    cfg = load_config(None, ["rollout.n=100000000"])
    with pytest.raises(ConfigError) as error:
        check_host_memory(cfg, validate(cfg))
    text = str(error.value)
    assert "rollout.n = 100000000" in text and "16.0 GiB is free (test)" in text
    assert "GiB on the controller" in text and "lower rollout.n" in text


def test_a_run_that_fits_passes(monkeypatch):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (16 * 2**30, "test"))
    cfg = load_config("examples/grpo.yaml")
    assert check_host_memory(cfg, validate(cfg)).total < 2**30


def test_unknown_free_memory_is_not_checked():
    need = HostNeed(samples=10**12, data_bytes=10**15, model_bytes=0, what="x")
    assert host_memory.host_problems(need, load_config(), None, "") == []


def test_free_memory_is_read_on_linux():
    available, source = host_memory.available_host_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    assert available > 0 and source


DEEPSEEK_96 = ["model.path=deepseek-v3", "trainer.backend=ray", "trainer.nnodes=12",
               "trainer.n_gpus_per_node=8", "trainer.device=cuda", "data.train_batch_size=96",
               "actor.ppo_mini_batch_size=24", "data.max_prompt_length=1024",
               "data.max_response_length=4096", "rollout.n=8", "actor.use_kl_loss=true",
               "actor.expert_parallel_size=32", "rollout.expert_parallel_size=32",
               "actor.param_offload=true", "ref.param_offload=true",
               "model.gradient_checkpointing=true", "actor.max_tokens_per_gpu=16384"]  # fmt: skip
LLAMA70_8 = ["model.path=llama3.1-70b", "trainer.backend=local", "trainer.n_gpus_per_node=8",
             "trainer.device=cuda", "data.train_batch_size=128", "actor.ppo_mini_batch_size=32",
             "rollout.n=8", "actor.use_kl_loss=true", "actor.tensor_parallel_size=2",
             "rollout.tensor_parallel_size=8", "model.gradient_checkpointing=true",
             "actor.param_offload=true", "actor.max_tokens_per_gpu=16384"]  # fmt: skip


def _offloaded_per_gpu(plan, reference: bool) -> int:
    """By hand: a training GPU's shares of what param_offload puts on the host: fp32 masters,
    gradients and AdamW's two moments (16 bytes a parameter), the bf16 reference (2 more)
    with ref.param_offload."""
    parameters, ranks = plan.architecture.num_parameters(), plan.options.train_gpus
    actor = 2 * (parameters * 4 // ranks) + parameters * 8 // ranks
    return actor + (parameters * 2 // ranks if reference else 0)


@pytest.mark.parametrize("layout, gpus_on_a_host", [(LLAMA70_8, 8), (DEEPSEEK_96, 8)])
def test_the_host_holds_the_offloaded_shares_of_its_own_gpus(layout, gpus_on_a_host):
    """One node of 8 GPUs holds 8 GPUs' shares: all of the state for Llama-3.1-70B on 8 ×
    80 GiB, a twelfth of it for DeepSeek-V3 on 12 nodes × 8 (937 GiB, not 11 TiB)."""
    from hybridflow.trainer.plan.memory_from_config import plan_for_config
    from hybridflow.trainer.plan.memory_render import render

    cfg = load_config(None, layout)
    derived = validate(cfg)
    plan = plan_for_config(cfg, derived, 96 * 10**9)
    per_gpu = _offloaded_per_gpu(plan, cfg.ref.param_offload)
    assert plan.host_bytes() == gpus_on_a_host * per_gpu
    need = host_need(cfg, derived, plan)
    assert need.model_bytes == plan.host_bytes()
    several_nodes = cfg.trainer.nnodes > 1
    assert ("of one node's 8 GPUs (of 96)" in need.model_what) == several_nodes
    assert ("a node (the shares of its 8 GPUs)" in render(plan)) == several_nodes
    if several_nodes:
        assert 930 * 2**30 < plan.host_bytes() < 940 * 2**30


def test_validate_checks_a_nodes_host_memory_as_the_plan_prints_it(monkeypatch):
    """DeepSeek-V3 on 12 × 8 GPUs with its training state offloaded fits hosts of 1 TiB free
    (each holds its 8 GPUs' shares); hosts of 512 GiB are refused with the node's numbers."""
    from hybridflow.trainer.plan.memory_from_config import plan_for_config
    from hybridflow.trainer.plan.plan_command import plan_command

    cfg = load_config(None, DEEPSEEK_96)
    derived = validate(cfg)
    plan = plan_for_config(cfg, derived, 96 * 10**9)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**40, "test"))
    assert check_host_memory(cfg, derived, plan).total < 2**40
    out = []
    with pytest.raises(ConfigError) as error:  # the GPU does not fit at these sizes
        plan_command(cfg, "96GB", out=out.append)
    assert not any("host memory" in p for p in error.value.problems)
    assert any(line.startswith("  host: ") and line.endswith(": fits") for line in out)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**39, "test"))
    with pytest.raises(ConfigError) as error:
        check_host_memory(cfg, derived, plan)
    text = str(error.value)
    assert "of one node's 8 GPUs (of 96)" in text and "512.0 GiB is free (test)" in text
    assert "more nodes (trainer.nnodes)" in text


def test_a_cpu_rollout_cache_past_the_host_is_refused_naming_max_num_seqs(monkeypatch):
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (16 * 2**30, "test"))
    cfg = load_config(None, ["trainer.device=cpu", "model.path=tiny",
                             "rollout.max_num_seqs=1000000", "data.max_response_length=512"])  # fmt: skip
    plan = plan_for_config(cfg, validate(cfg))
    (cache,) = [item for item in plan.items if item.name.startswith("KV cache")]
    need = host_need(cfg, validate(cfg), plan, on_cpu=True)
    assert need.kv_cache_bytes == cache.gpu_bytes > 16 * 2**30  # the engine zeroes it all
    with pytest.raises(ConfigError) as error:
        check_host_memory(cfg, validate(cfg))
    text = str(error.value)
    assert "rollout.max_num_seqs = 1,000,000 sequences of up to 32 + 512 tokens" in text
    assert "lower rollout.max_num_seqs" in text
    # the same cache on a GPU is sized from the GPU's memory: not the host's to hold
    assert host_need(cfg, validate(cfg), plan, on_cpu=False).kv_cache_bytes == 0
