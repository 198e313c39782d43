"""`hybridflow train` of the mixture-of-experts presets on two CPU processes, the rollout's
experts split over its tensor-parallel ranks or spread over its replicas (resharded from an
FSDP2 or an expert-parallel actor, with LoRA on the experts), logs the metrics and writes the
samples of plain data parallelism on the same two processes, step after step."""

from __future__ import annotations

import pytest
from rollout_layout_helpers import PLAIN, VERL, assert_same, read_samples, train_run

# tiny-moe replaying the rollout's routes in the actor (after TINY's model.path)
MOE = ("model.path=tiny-moe", "actor.router_replay=rollout")


@pytest.fixture(scope="module")
def moe_data_parallel(tmp_path_factory):
    """The data-parallel run of MOE that two layouts below are compared with: run once."""
    run = tmp_path_factory.mktemp("moe_dp")
    return train_run(run, *PLAIN, *MOE), run


@pytest.mark.slow
def test_a_mixture_of_experts_rollout_with_split_experts_logs_the_metrics_of_data_parallel(
    tmp_path, moe_data_parallel
):
    """tiny-moe with verl's rollout TP = 2 and EP = 2 (each process holds 4 of the 8 experts
    of every sparse layer, resharded from the actor's FSDP2 shards) and the trainer replaying
    the rollout's routing (actor.router_replay=rollout: the engine's record, the same on both
    ranks, returned once per sample) logs the metrics of data parallelism; so does the same
    rollout resharded from an expert-parallel actor (EP = 2: each process trains 4 experts)."""
    rollout = (
        VERL + "rollout.tensor_model_parallel_size=2",
        VERL + "rollout.expert_parallel_size=2",
    )
    plain, plain_dir = moe_data_parallel
    layouts = {
        "layout": train_run(tmp_path / "layout", *MOE, *rollout),
        "ep": train_run(tmp_path / "ep", *MOE, *rollout, "actor.expert_parallel_size=2",
                          "critic.expert_parallel_size=1"),
    }  # fmt: skip
    for name, layout in layouts.items():
        assert plain.keys() == layout.keys() == {1, 2}
        for step, want in plain.items():
            assert_same(want, layout[step], step)
            assert read_samples(plain_dir, step) == read_samples(tmp_path / name, step)


@pytest.mark.slow
def test_experts_over_rollout_replicas_and_offloaded_expert_shards_log_data_parallel(
    tmp_path, moe_data_parallel
):
    """tiny-moe with the rollout's experts spread over its two replicas of one process each
    (rollout.expert_parallel_size=2: attention data-parallel, 4 experts a process, the tokens
    dispatched by all-to-all; engine/expert_spread.py), resharded from an expert-parallel
    actor whose expert shards and AdamW state are on the host (actor.param_offload), logs the
    metrics and samples the tokens of plain data parallelism."""
    plain, plain_dir = moe_data_parallel
    wide = train_run(tmp_path / "wide", *MOE, "rollout.expert_parallel_size=2",
                       "actor.expert_parallel_size=2", "critic.expert_parallel_size=1",
                       "actor.param_offload=true", "ref.param_offload=true")  # fmt: skip
    assert plain.keys() == wide.keys() == {1, 2}
    for step, want in plain.items():
        assert_same(want, wide[step], step)
        assert read_samples(plain_dir, step) == read_samples(tmp_path / "wide", step)


@pytest.mark.slow
def test_expert_lora_with_a_tensor_parallel_rollout_logs_data_parallel(tmp_path):
    """tiny-moe with LoRA on its experts (per-expert factors) and attention, rollout TP = 2
    with the experts split: each sync merges W_e + scale · B_e @ A_e of a rank's own experts
    as they reshard (workers/rollout_tp.training_sources); the run logs the metrics and
    samples the tokens of data parallelism, where the engines get whole merged tensors."""
    lora = ("model.path=tiny-moe", "model.lora_rank=8", "model.lora_alpha=16",
            "model.lora_target_modules=[q_proj,experts]", "actor.lr=1e-2")  # fmt: skip
    plain = train_run(tmp_path / "dp", *PLAIN, *lora)
    layout = train_run(tmp_path / "tp", *lora, VERL + "rollout.tensor_model_parallel_size=2")
    assert plain.keys() == layout.keys() == {1, 2}
    for step, want in plain.items():
        assert_same(want, layout[step], step)
        assert read_samples(tmp_path / "dp", step) == read_samples(tmp_path / "tp", step)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-gpt-oss"])
def test_experts_of_each_family_over_rollout_replicas_log_data_parallel(tmp_path, preset):
    """tiny-deepseek-v3 (MLA, grouped routing, a shared expert) and tiny-gpt-oss (a router
    with a bias, experts with biases) with their rollout experts spread over two replicas of
    one process, the weights resharded from an FSDP2 actor (GPT-OSS's expert biases with
    their experts), log the metrics and sample the tokens of data parallelism."""
    model = (f"model.path={preset}",)
    plain = train_run(tmp_path / "dp", *PLAIN, *model)
    wide = train_run(tmp_path / "wide", *model, "rollout.expert_parallel_size=2")
    assert plain.keys() == wide.keys() == {1, 2}
    for step, want in plain.items():
        assert_same(want, wide[step], step)
        assert read_samples(tmp_path / "dp", step) == read_samples(tmp_path / "wide", step)


@pytest.mark.slow
def test_deepseek_v3_with_a_tensor_parallel_rollout_logs_data_parallel(tmp_path):
    """tiny-deepseek-v3 with LoRA and verl's rollout TP = 2 (MLA split by heads, the latent
    whole on each process, the shared expert by columns, 4 of the 8 routed experts a
    process; adapters merged as they reshard, routes replayed) logs the metrics and writes
    the samples of data parallelism on the same two processes."""
    deepseek = ("model.path=tiny-deepseek-v3", "actor.router_replay=rollout", "model.lora_rank=4")
    plain = train_run(tmp_path / "plain", *PLAIN, *deepseek)
    layout = train_run(tmp_path / "tp", *deepseek, VERL + "rollout.tensor_model_parallel_size=2")
    assert plain.keys() == layout.keys() == {1, 2}
    for step, want in plain.items():
        assert_same(want, layout[step], step)
        assert read_samples(tmp_path / "plain", step) == read_samples(tmp_path / "tp", step)


@pytest.mark.slow
def test_agent_episodes_with_experts_over_rollout_replicas_log_data_parallel(tmp_path):
    """rollout.agent.loop=tools with tiny-moe's rollout experts spread over two replicas of
    one process: each rank runs its own rows' episodes, its service joining the expert
    group's rounds while any rank has turns to run (engine/serving/spread_rounds.py); the
    metrics and samples are those of a data-parallel rollout."""
    agents = ("model.path=tiny-moe", "rollout.agent.loop=tools",
              "rollout.agent.tools=[calculator]", "data.max_prompt_length=64",
              "reward.custom_fn=null", "trainer.total_steps=1")  # fmt: skip
    plain = train_run(tmp_path / "dp", *PLAIN, *agents)
    wide = train_run(tmp_path / "wide", *agents, "rollout.expert_parallel_size=2")
    assert plain.keys() == wide.keys() == {1}
    assert_same(plain[1], wide[1], 1)
    assert read_samples(tmp_path / "dp", 1) == read_samples(tmp_path / "wide", 1)


@pytest.mark.slow
def test_partial_rollouts_with_experts_over_rollout_replicas_log_data_parallel(tmp_path):
    """trainer.mode=async with partial rollouts and tiny-moe's rollout experts spread over two
    replicas: the rollout runs as a service on each rank, the services in the expert group's
    rounds, the weights resharded into them between the same two rounds (a group operation
    of every rank). Step 1 (drawn before the first sync) logs the metrics and samples the
    tokens of a data-parallel rollout; step 2's sync lands where timing puts it (the exact
    update: tests/engine/serving/test_spread_service.py), so it is only run."""
    partial = ("model.path=tiny-moe", "trainer.mode=async", "trainer.partial_rollout=true",
               "trainer.total_steps=2")  # fmt: skip
    plain = train_run(tmp_path / "dp", *PLAIN, *partial)
    wide = train_run(tmp_path / "wide", *partial, "rollout.expert_parallel_size=2")
    assert plain.keys() == wide.keys() == {1, 2}
    assert_same(plain[1], wide[1], 1)
    assert read_samples(tmp_path / "dp", 1) == read_samples(tmp_path / "wide", 1)
