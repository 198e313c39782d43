"""validate()'s parallel-layout rules: sizes tile the devices, the model's dimensions divide,
verl's batch normalisation, and the refusal of layouts whose code path does not exist yet."""

import pytest

from hybridflow.config import ConfigError, load_config, parallel_checks, validate

FOUR_CPUS = ["trainer.backend=local", "trainer.n_gpus_per_node=4", "trainer.device=cpu"]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    return e.value.problems


def _supporting(monkeypatch, *pairs):
    """Validate as after the change that lands these (role, dimension) code paths."""
    monkeypatch.setattr(parallel_checks, "SUPPORTED_LAYOUTS", frozenset(pairs))


@pytest.mark.parametrize(
    ("key", "role"),
    [
        ("rollout.tensor_parallel_size", "rollout"),
    ],
)
def test_a_layout_without_its_code_path_is_refused_naming_the_key(key, role, monkeypatch):
    _supporting(monkeypatch)  # as before the rollout's tensor parallelism landed
    problems = _problems([*FOUR_CPUS, f"{key}=2"])
    assert problems == [
        f"{key} = 2: {parallel_checks.WHAT[key.split('.')[1][0] + 'p']} is not yet supported "
        f"for the {role}: set {key}=1 (docs/parallelism.md says what each role runs in today)"
    ]


def test_the_reference_following_the_actor_is_refused_with_its_own_key(monkeypatch):
    _supporting(monkeypatch, ("actor", "tp"))
    problems = _problems([*FOUR_CPUS, "actor.tensor_parallel_size=2", "actor.use_kl_loss=true"])
    assert len(problems) == 1
    assert problems[0].startswith(
        "actor.tensor_parallel_size = 2 (ref.tensor_parallel_size is unset and follows "
        "actor.tensor_parallel_size): tensor parallelism is not yet supported "
        "for the reference: set ref.tensor_parallel_size=1"
    )
    # the reference's own key lifts it
    validate(load_config(None, [*FOUR_CPUS, "actor.tensor_parallel_size=2",
                                "actor.use_kl_loss=true", "ref.tensor_parallel_size=1"]))  # fmt: skip


def test_a_tensor_parallel_rollout_is_accepted_and_what_it_does_not_run_yet_refused():
    """engine/tensor_parallel.py and engine/reshard.py; verl's key translates to it."""
    derived = validate(load_config(None, [*FOUR_CPUS, "rollout.tensor_parallel_size=2"]))
    assert (derived.layouts.rollout.tp, derived.rollout_dp_size) == (2, 2)
    partial = [*FOUR_CPUS, "rollout.tensor_parallel_size=2", "trainer.mode=async",
               "trainer.partial_rollout=true"]  # fmt: skip
    validate(load_config(None, partial))  # its ranks serve in lockstep (serving/lockstep.py)
    # the fused decode layers sum over the group (engine/layers/split.py), and the fp8
    # rollout runs on them, whichever key asks for it
    validate(load_config(None, [*partial, "rollout.engine.decode_backend=triton"]))
    four_gpus = ["trainer.backend=local", "trainer.n_gpus_per_node=4", "trainer.device=cuda"]
    for key in ("rollout.dtype=fp8", "rollout.engine.weight_format=fp8"):
        validate(load_config(None, [*four_gpus, "rollout.tensor_parallel_size=2", key]))
    # agent loops: each rank's turns and releases of kept KV run in lockstep too
    agents = [*FOUR_CPUS, "rollout.tensor_parallel_size=2", "rollout.agent.tools=[calculator]"]
    validate(load_config(None, [*agents, "rollout.agent.loop=tools"]))
    # experts over several replicas: each replica's service joins the expert group's rounds
    # (engine/serving/spread_rounds.py), of one rank or tensor-parallel
    for tp in (1, 2):
        validate(load_config(None, [*agents, "rollout.agent.loop=tools", "model.path=tiny-moe",
                                    "rollout.expert_parallel_size=4",
                                    f"rollout.tensor_parallel_size={tp}"]))  # fmt: skip
        validate(load_config(None, [*partial, "model.path=tiny-moe",
                                    "rollout.expert_parallel_size=4",
                                    f"rollout.tensor_parallel_size={tp}"]))  # fmt: skip
    # experts over several replicas, of one rank or tensor-parallel, on the fused layers
    # (layers/moe.experts_triton dispatches by all-to-all), the fp8 rollout's included
    for tp in (1, 2):
        for key in ("rollout.engine.decode_backend=triton", "rollout.dtype=fp8"):
            validate(load_config(None, [*four_gpus, "model.path=tiny-moe", key,
                                        "rollout.expert_parallel_size=4",
                                        f"rollout.tensor_parallel_size={tp}"]))  # fmt: skip


def test_a_tensor_parallel_rollout_of_experts_splits_them_or_holds_them_whole():
    """engine/tensor_parallel.py: unset or equal to the rollout's tp, rollout.expert_parallel_size
    splits the experts over a replica's ranks; 1 holds them whole; a multiple spreads them over
    several replicas (engine/expert_spread.py); expert adapters merge as they move."""
    moe = [*FOUR_CPUS, "model.path=tiny-moe", "rollout.tensor_parallel_size=2"]
    for extra in ([], ["rollout.expert_parallel_size=2"], ["rollout.expert_parallel_size=1"],
                  ["rollout.expert_parallel_size=4"]):  # fmt: skip
        derived = validate(load_config(None, [*moe, *extra]))
        assert (derived.layouts.rollout.tp, derived.rollout_dp_size) == (2, 2)
    assert derived.layouts.rollout.ep == 4
    # expert adapters merge as they reshard (workers/rollout_tp.training_sources)
    for extra in ([], ["rollout.expert_parallel_size=4"]):
        validate(load_config(None, [*moe, *extra, "model.lora_rank=4"]))
    # an expert-parallel actor's expert shards (FSDP2-sharded too) reshard like any block
    for ep in (2, 4):
        validate(load_config(None, [*moe, f"actor.expert_parallel_size={ep}"]))
    problems = _problems([*FOUR_CPUS, "model.path=tiny-moe", "rollout.tensor_parallel_size=4"])
    assert any("rollout.tensor_parallel_size = 4 must divide the model's KV heads" in p
               for p in problems)  # fmt: skip


@pytest.mark.parametrize("dim", ["sequence", "tensor"])
def test_sequence_and_tensor_parallel_training_roles_are_accepted(dim):
    """Ulysses (learners/sharding/sequence_shard.py) and tensor parallelism (models/sharding/tensor_parallel.py)
    run for the actor, the reference and the critic."""
    derived = validate(load_config(None, [*FOUR_CPUS, f"actor.{dim}_parallel_size=2",
                                          "actor.use_kl_loss=true", "algorithm.adv_estimator=gae"]))  # fmt: skip
    assert derived.use_reference and derived.use_critic
    for layout in (derived.layouts.actor, derived.layouts.ref, derived.layouts.critic):
        assert (layout.sp, layout.tp) == ((2, 1) if dim == "sequence" else (1, 2))


def test_expert_parallel_actor_reference_and_rollout_over_replicas_are_accepted():
    """Expert parallelism trains the actor and runs the reference (learners/sharding/expert_shard.py);
    the rollout spreads the experts over replicas of one rank (engine/expert_spread.py),
    refusing what runs at each replica's own pace by key."""
    moe = [*FOUR_CPUS, "model.path=tiny-moe", "actor.use_kl_loss=true"]
    derived = validate(load_config(None, [*moe, "actor.expert_parallel_size=2"]))
    assert derived.layouts.actor.ep == derived.layouts.ref.ep == 2
    derived = validate(load_config(None, [*moe, "rollout.expert_parallel_size=4"]))
    assert (derived.layouts.rollout.tp, derived.layouts.rollout.ep) == (1, 4)
    validate(load_config(None, [*moe, "rollout.expert_parallel_size=2",
                                "rollout.engine.decode_backend=triton"]))  # fmt: skip
    problems = _problems([*moe, "rollout.expert_parallel_size=2",
                          "rollout.engine.decode_backend=triton", "rollout.engine.cuda_graphs=true"])  # fmt: skip
    assert problems == [
        "rollout.expert_parallel_size = 2 (experts over several replicas) with "
        "rollout.engine.cuda_graphs = true: not yet supported (the all-to-all's sizes are read "
        "on the host at every sparse layer); set rollout.expert_parallel_size=1, or leave "
        "rollout.engine.cuda_graphs unset"]  # fmt: skip
    problems = _problems([*moe, "rollout.expert_parallel_size=3"])
    assert any("rollout.expert_parallel_size = 3 must" in p for p in problems)


def test_sizes_that_do_not_tile_the_devices_name_the_keys():
    problems = _problems([*FOUR_CPUS, "actor.tensor_parallel_size=3"])
    assert ("actor layout: trainer.n_gpus_per_node = 4 is not a multiple of "
            "actor.tensor_parallel_size × actor.sequence_parallel_size = 3 × 1") in problems  # fmt: skip
    problems = _problems(["trainer.backend=local", "trainer.n_gpus_per_node=4",
                          "trainer.placement=split", "trainer.rollout_gpus=1",
                          "rollout.tensor_parallel_size=2"])  # fmt: skip
    assert ("rollout layout: trainer.rollout_gpus = 1 is not a multiple of "
            "rollout.tensor_parallel_size = 2") in problems  # fmt: skip


def test_heads_kv_heads_and_experts_divide():
    # tiny: 4 heads, 2 KV heads, vocabulary 128, MLP width 192
    problems = _problems([*FOUR_CPUS, "model.path=tiny", "actor.tensor_parallel_size=4"])
    assert ("actor: actor.tensor_parallel_size = 4 must divide the model's KV heads = 2: pick "
            "a divisor of 2") in problems  # fmt: skip
    # tiny-moe: 8 experts
    problems = _problems(["trainer.backend=local", "trainer.n_gpus_per_node=3",
                          "trainer.device=cpu", "data.train_batch_size=3",
                          "actor.ppo_mini_batch_size=3", "actor.micro_batch_size_per_gpu=1",
                          "model.path=tiny-moe", "actor.expert_parallel_size=3"])  # fmt: skip
    assert ("actor: actor.expert_parallel_size = 3 must divide the model's experts "
            "(num_experts = 8): pick a divisor of 8") in problems  # fmt: skip
    problems = _problems([*FOUR_CPUS, "model.path=tiny", "rollout.expert_parallel_size=2"])
    assert any("this model has none: set rollout.expert_parallel_size=1" in p for p in problems)


def test_sequence_parallel_beyond_the_kv_heads_replicates_them(monkeypatch):
    _supporting(monkeypatch, ("actor", "sp"))
    # tiny: 2 KV heads, sp = 4: each KV head on 4 / 2 = 2 ranks; 4 heads / 4 = 1 each: valid
    cfg = load_config(None, [*FOUR_CPUS, "model.path=tiny", "actor.sequence_parallel_size=4"])
    validate(cfg)
    notes = parallel_checks.layout_notes(cfg, {"actor"})
    assert notes == ["actor: sequence_parallel_size 4 exceeds the 2 KV head(s) per "
                     "tensor-parallel rank: each KV head is replicated on 2 ranks around "
                     "attention"]  # fmt: skip
    # sp = 8 over 4 attention heads: a rank would hold half a head
    problems = _problems(["trainer.backend=local", "trainer.n_gpus_per_node=8",
                          "trainer.device=cpu", "model.path=tiny",
                          "actor.sequence_parallel_size=8"])  # fmt: skip
    assert ("actor: actor.sequence_parallel_size = 8 must divide the attention heads per "
            "tensor-parallel rank = 4 / 1 = 4 (Ulysses gives each rank whole heads)") in problems  # fmt: skip


def test_batch_sizes_after_verls_normalisation(monkeypatch):
    _supporting(monkeypatch, ("actor", "sp"), ("actor", "tp"))
    # 8 devices, tp = 2, sp = 2: data-parallel ranks = 8 / (2 × 2) = 2.
    # mini-batch per GPU = ppo_mini_batch_size × n / dp = 4 × 4 / 2 = 8 samples,
    # micro-batches = 8 / micro_batch_size_per_gpu 2 = 4.
    base = ["trainer.backend=local", "trainer.n_gpus_per_node=8", "trainer.device=cpu",
            "model.path=tiny", "actor.tensor_parallel_size=2", "actor.sequence_parallel_size=2",
            "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size_per_gpu=2"]  # fmt: skip
    derived = validate(load_config(None, base))
    assert derived.train_dp_size == 2
    assert derived.mini_batch_samples_per_gpu == 8
    assert derived.micro_batches_per_mini_batch == 4
    assert derived.layouts.actor.size("fsdp") == 4  # FSDP2 shards over dp × sp
    # ppo_mini_batch_size = 1: 1 × 4 / 2 = 2 samples per GPU, not a multiple of 4
    problems = _problems([*base, "actor.ppo_mini_batch_size=1", "actor.micro_batch_size_per_gpu=4"])
    assert ("actor mini-batch per GPU = actor.ppo_mini_batch_size × rollout.n / data-parallel "
            "ranks = 1 × 4 / 2 = 2 samples is not a multiple of "
            "actor.micro_batch_size_per_gpu = 4: pick a divisor of 2") in problems  # fmt: skip


def test_a_mini_batch_smaller_than_the_data_parallel_ranks_shows_the_normalisation():
    # 4 devices, sp = 2 -> 2 data-parallel ranks; 1 prompt × 3 samples cannot split over 2
    problems = _problems([*FOUR_CPUS, "actor.sequence_parallel_size=2", "rollout.n=3",
                          "data.train_batch_size=2", "actor.ppo_mini_batch_size=1"])  # fmt: skip
    assert any(
        p.startswith(
            "actor.ppo_mini_batch_size × rollout.n = 1 × 3 = 3 samples cannot be split "
            "over 2 data-parallel ranks (its 4 devices / (actor.tensor_parallel_size × "
            "actor.sequence_parallel_size = 1 × 2))"
        )  # fmt: skip
        for p in problems
    )


def test_tensor_parallel_training_of_experts_or_lora_is_refused():
    problems = _problems([*FOUR_CPUS, "model.path=tiny-moe", "actor.tensor_parallel_size=2"])
    assert ("actor: actor.tensor_parallel_size = 2: tensor parallelism of a mixture of experts' "
            "sparse layers is not built yet: set actor.tensor_parallel_size=1 (data, sequence "
            "and expert parallelism train it)") in problems  # fmt: skip
    problems = _problems([*FOUR_CPUS, "model.path=tiny", "model.lora_rank=4",
                          "actor.tensor_parallel_size=2"])  # fmt: skip
    assert problems == ["actor: actor.tensor_parallel_size = 2 with model.lora_rank = 4: tensor "
                        "parallelism of LoRA adapters is not built yet: set "
                        "actor.tensor_parallel_size=1 (sequence parallelism trains them) or "
                        "model.lora_rank=0"]  # fmt: skip
    validate(load_config(None, [*FOUR_CPUS, "model.path=tiny", "model.lora_rank=4",
                                "actor.sequence_parallel_size=2"]))  # fmt: skip


def test_offloaded_expert_parallel_shards_pass_and_the_host_step_is_refused():
    """FSDP2's param_offload holds the experts' shards on the host (learners/sharding/
    expert_shard.py); the one-device host step (optimizer_offload) is refused by key."""
    validate(load_config(None, [*FOUR_CPUS, "model.path=tiny-moe",
                                "actor.expert_parallel_size=2", "actor.param_offload=true",
                                "ref.param_offload=true", "actor.use_kl_loss=true"]))  # fmt: skip
    problems = _problems([*FOUR_CPUS, "model.path=tiny-moe", "actor.expert_parallel_size=2",
                          "actor.optimizer_offload=true"])  # fmt: skip
    assert ("actor: actor.optimizer_offload = true with actor.expert_parallel_size = 2: the host "
            "step runs on one device only: set actor.optimizer_offload=false and "
            "actor.param_offload=true (FSDP2 keeps each rank's expert shards and their AdamW "
            "state on the host), or actor.expert_parallel_size=1") in problems  # fmt: skip


def test_lora_on_expert_parallel_experts_validates():
    """keep_local_experts splits each expert's adapters with it: LoRA on the experts, or on
    attention only, trains with EP."""
    moe = [*FOUR_CPUS, "model.path=tiny-moe", "actor.expert_parallel_size=2", "model.lora_rank=4"]
    validate(load_config(None, [*moe, "model.lora_target_modules=[q_proj,experts]"]))
    validate(load_config(None, [*moe, "model.lora_target_modules=[q_proj,v_proj]"]))


def test_a_tensor_parallel_rollout_of_shared_experts_needs_their_width_to_divide():
    """DeepSeek's shared experts split like a dense MLP (engine/tensor_parallel.py)."""
    from hybridflow.models.presets import preset_config

    cfg = load_config(None, ["rollout.tensor_parallel_size=8", "model.path=tiny-deepseek-v3"])
    arch = preset_config("tiny-deepseek-v3")
    assert parallel_checks.rollout_tensor_parallel_limits(cfg, arch) == []
    narrow = arch.replace(moe_intermediate_size=20)
    assert parallel_checks.rollout_tensor_parallel_limits(cfg, narrow) == [
        "rollout.tensor_parallel_size = 8 must divide the width of the model's shared experts "
        "(moe_intermediate_size × n_shared_experts = 20): pick a divisor of 20"
    ]


def test_an_fp8_rollout_of_every_mixture_of_experts_validates():
    """The fp8 rollout covers routed SwiGLU experts on the fused layers (engine/fp8/
    experts.py: Qwen3-MoE, Mixtral) and the eager passes' layers (engine/fp8/linears.py):
    GPT-OSS (its biased experts in the model's dtype) and DeepSeek-V3 validate with either
    key, on one rank and on a tensor-parallel rollout (its row-parallel projections and
    split experts quantized too)."""
    gpu = ["trainer.device=cuda", "trainer.backend=local", "trainer.n_gpus_per_node=2"]
    for path in ("tiny-moe", "tiny-gpt-oss", "tiny-deepseek-v3"):
        for key in ("rollout.dtype=fp8", "rollout.engine.weight_format=fp8"):
            for size in (1, 2):
                validate(load_config(None, [*gpu, f"model.path={path}", key,
                                            f"rollout.tensor_parallel_size={size}"]))  # fmt: skip
