"""`hybridflow config plan` (trainer/plan/plan_command.py): --gpu-memory sizes, and the settings
left to the plan printed under its table."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.plan.memory_plan import GIB
from hybridflow.trainer.plan.plan_command import parse_size, plan_command


@pytest.mark.parametrize(
    "text, expected", [("141GiB", 141 * GIB), ("80GB", 80 * 10**9), ("80", 80 * GIB),
                       ("0.5 TiB", 2**39)],
)  # fmt: skip
def test_gpu_memory_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "9" * 400, "1e300", "80 parsecs"])
def test_a_gpu_memory_that_is_no_size_is_refused(text):
    with pytest.raises(ConfigError, match="--gpu-memory .* is not a size"):
        parse_size(text)


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-1", "0"])
@pytest.mark.parametrize("action", ["plan", "validate"])
def test_a_gpu_memory_gib_that_is_no_size_exits_2_naming_the_key(value, action, capsys):
    from hybridflow.cli import main

    status = main(["config", action, "model.path=tiny", f"trainer.gpu_memory_gib={value}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert "trainer.gpu_memory_gib" in err and "at most 1048576" in err, err


def test_config_plan_prints_the_choices():
    out = []
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", "actor.max_tokens_per_gpu=auto"])
    plan_command(cfg, "80GiB", out=out.append)
    assert any("actor.max_tokens_per_gpu=auto: " in line for line in out)
    assert any("model.gradient_checkpointing=auto: off" in line for line in out)
    assert any("actor.log_prob_max_tokens_per_gpu = " in line for line in out)


def test_a_cpu_run_is_planned_in_cpu_processes_not_training_gpus(capsys):
    from hybridflow.cli import main

    assert main(["config", "plan", "trainer.device=cpu", "model.path=tiny"]) == 0
    out = capsys.readouterr().out
    assert "1 training CPU process(es)" in out and "training GPU" not in out
    assert "this run's memory is the host line below" in out
    assert main(["config", "plan", "trainer.device=cuda", "model.path=tiny",
                 "trainer.gpu_memory_gib=80"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "1 training GPU(s)" in out and "per training GPU:" in out and "CPU process" not in out


LLAMA70_GRPO = ["model.path=llama3.1-70b", "trainer.backend=local", "trainer.n_gpus_per_node=8",
                "data.max_prompt_length=1024", "data.max_response_length=4096",
                "data.train_batch_size=128", "rollout.n=8", "actor.ppo_mini_batch_size=32",
                "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
                "rollout.gpu_memory_utilization=0.9"]  # fmt: skip


def test_a_tensor_parallel_layout_is_planned():
    out = []
    cfg = load_config(None, [*LLAMA70_GRPO, "actor.tensor_parallel_size=8",
                             "rollout.tensor_parallel_size=8", "actor.param_offload=true",
                             "model.gradient_checkpointing=true"])  # fmt: skip
    assert plan_command(cfg, "140GiB", out=out.append) == 0
    text = "\n".join(out)
    assert (
        "configured: actor tp 8 · sp 1 · ep 1 (data parallel 1), rollout tp 8 (1 replica)" in text
    )
    assert "rollout weights (bf16, tp 8)" in text and "reshard:" in text
    # both layouts have their code path (models/tensor_parallel.py, engine/tensor_parallel.py)
    assert "not yet supported" not in text


def test_the_reshard_line_is_the_block_plans_bytes_for_a_dense_model():
    """FSDP2 over 8 GPUs into a rollout of TP 8: 4.9 GiB into each GPU a sync (the row-parallel
    weights and the norms; tests/parallel/test_blocks.py has the arithmetic), not the 14.4 of
    the shard less its 1/8."""
    out = []
    cfg = load_config(None, [*LLAMA70_GRPO, "rollout.tensor_parallel_size=8",
                             "actor.param_offload=true", "model.gradient_checkpointing=true"])  # fmt: skip
    assert plan_command(cfg, "140GiB", out=out.append) == 0
    assert "reshard: 4.9 GiB into each rollout GPU a sync" in "\n".join(out)


def test_a_parallel_layout_that_does_not_fit_names_the_recommended_one():
    cfg = load_config(None, [*LLAMA70_GRPO, "actor.tensor_parallel_size=8"])
    with pytest.raises(ConfigError) as error:
        plan_command(cfg, "80GiB", out=lambda line: None)
    (problem,) = error.value.problems
    assert problem.startswith("the configured layout (actor tp 8")
    assert "the plan recommends: " in problem and "actor.param_offload=true" in problem


def test_deepseek_v3_is_planned_and_validated_as_a_preset_of_the_runtime():
    out = []
    cfg = load_config(None, ["model.path=deepseek-v3", "trainer.backend=ray", "trainer.nnodes=12",
                             "trainer.n_gpus_per_node=8", "data.train_batch_size=96",
                             "actor.ppo_mini_batch_size=24", "data.max_prompt_length=1024",
                             "data.max_response_length=4096", "rollout.n=8",
                             "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
                             "rollout.gpu_memory_utilization=0.9", "actor.tensor_parallel_size=8",
                             "actor.expert_parallel_size=4", "rollout.tensor_parallel_size=8",
                             "rollout.expert_parallel_size=32", "actor.param_offload=true",
                             "model.gradient_checkpointing=true"])  # fmt: skip
    assert plan_command(cfg, "96GB", out=out.append) == 0
    assert out[0].startswith("Parallel layout plan: deepseek-v3 (671.03 B parameters")
    with pytest.raises(ConfigError) as error:  # the layouts, not the model
        validate(cfg)
    assert not any("deepseek-v3" in p for p in error.value.problems)
    assert any(p.startswith("actor: actor.tensor_parallel_size = 8") for p in error.value.problems)


def test_a_data_parallel_run_on_several_gpus_gets_the_layout_advice_too():
    out = []
    cfg = load_config(None, [*LLAMA70_GRPO])
    with pytest.raises(ConfigError):  # today's data-parallel plan: does not fit
        plan_command(cfg, "80GiB", out=out.append)
    text = "\n".join(out)
    assert "Parallel layout plan: llama3.1-70b" in text and "recommended: actor tp" in text


# The large cases of docs/parallelism.md ("The plan at scale"): the GRPO shape shared there,
# the devices, and what the plan recommends (its "set:" line) with the KV cache a replica
# holds, as the table shows them.
AT_SCALE = ["data.max_prompt_length=1024", "data.max_response_length=4096", "rollout.n=8",
            "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
            "rollout.gpu_memory_utilization=0.9", "actor.use_kl_loss=true", "trainer.backend=ray",
            "trainer.n_gpus_per_node=8"]  # fmt: skip
TP, EP = "tensor_parallel_size", "expert_parallel_size"
OFFLOAD = "model.gradient_checkpointing=true actor.param_offload=true"


@pytest.mark.parametrize(
    "model, nodes, memory, batch, recommended, sequences",
    [("llama3.1-70b", 1, "80GiB", 128, f"actor.{TP}=2 rollout.{TP}=8 {OFFLOAD}", 204),
     ("llama3.1-70b", 2, "140GiB", 128, f"actor.{TP}=2 rollout.{TP}=8 "
      "model.gradient_checkpointing=true", 256),
     ("qwen3-235b-a22b", 4, "80GiB", 128, f"actor.{EP}=32 rollout.{EP}=32 {OFFLOAD}", 34),
     ("qwen3-235b-a22b", 8, "140GiB", 128, f"actor.{EP}=64 rollout.{EP}=64 "
      "model.gradient_checkpointing=true", 66),
     ("deepseek-v3", 12, "96GB", 96, f"actor.{TP}=4 actor.{EP}=8 rollout.{TP}=8 rollout.{EP}=32 "
      f"{OFFLOAD}", 86)],
)  # fmt: skip
def test_the_large_cases_of_the_parallelism_page(model, nodes, memory, batch, recommended,
                                                 sequences):  # fmt: skip
    out = []
    cfg = load_config(None, [f"model.path={model}", f"trainer.nnodes={nodes}",
                             f"data.train_batch_size={batch}",
                             f"actor.ppo_mini_batch_size={batch // 4}", *AT_SCALE])  # fmt: skip
    with pytest.raises(ConfigError):  # the data-parallel layout of the config does not fit
        plan_command(cfg, memory, out=out.append)
    lines = "\n".join(out).splitlines()
    start = next(i for i, line in enumerate(lines) if "  recommended: " in line)
    assert lines[start + 1].strip() == f"set: {recommended}"
    kv = next(line for line in lines[start:] if line.strip().startswith("KV cache: "))
    assert kv.strip().startswith(f"KV cache: {sequences} sequences of 5,120 tokens")


def test_the_reshard_line_of_a_mixture_of_experts_counts_each_ranks_experts():
    """tiny-moe colocated on 2 devices into rollout TP 2: with the experts split, FSDP2's
    row chunks are each rank's experts and never move; held whole (expert_parallel_size=1)
    each rank also receives the other half: 3 sparse layers × 4 experts × (256 + 128) × 128
    elements × 2 bytes (the plan's bf16 rollout copy) = 1,179,648 bytes more."""
    from hybridflow.config import validate
    from hybridflow.trainer.plan.parallel_section import setup_from_config, sync_bytes

    def received(*extra: str) -> int:
        cfg = load_config(None, ["model.path=tiny-moe", "trainer.backend=local", "trainer.device=cpu",
                                 "trainer.n_gpus_per_node=2", "rollout.tensor_parallel_size=2",
                                 *extra])  # fmt: skip
        return sync_bytes(cfg, setup_from_config(cfg, validate(cfg), 2**30))

    split, whole = received(), received("rollout.expert_parallel_size=1")
    assert whole - split == 3 * 4 * (256 + 128) * 128 * 2
    assert split == received("rollout.expert_parallel_size=2")


def test_the_rollout_copy_holds_every_expert_when_asked():
    """tiny-moe's routed experts: 3 sparse layers × 8 experts × 3 × 128 × 128 = 1,179,648
    parameters; over rollout TP 2 a rank holds half of them, with
    rollout.expert_parallel_size=1 all of them: 589,824 more."""
    from hybridflow.models.plan_shapes import shape_of
    from hybridflow.models.presets import preset_config
    from hybridflow.trainer.plan.parallel_plan import rollout_share

    shape = shape_of(preset_config("tiny-moe"))
    assert shape.routed_params == 3 * 8 * 3 * 128 * 128
    split, whole = rollout_share(shape, 2, 1), rollout_share(shape, 2, 1, experts_whole=True)
    assert whole - split == 589_824
    assert rollout_share(shape, 2, 2) == split  # ep = tp: the same split
