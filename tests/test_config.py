import pytest

from hybridflow.config import Config, ConfigError, field_docs, load_config, validate


def _problems(overrides):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    return "\n".join(e.value.problems)


def test_defaults_validate():
    d = validate(Config())
    assert d.samples_per_step == Config().data.train_batch_size * Config().rollout.n


def test_precedence_defaults_yaml_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  n: 4\n  temperature: 0.7\nactor:\n  lr: 1.0e-5\n")
    cfg = load_config(f, ["rollout.n=16"])
    assert cfg.rollout.n == 16  # override beats YAML
    assert cfg.rollout.temperature == 0.7  # YAML beats default
    assert cfg.actor.lr == 1e-5
    assert cfg.actor.grad_clip == Config().actor.grad_clip  # default kept


def test_unknown_key_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.temprature=0.5"])
    assert "rollout.temprature" in str(e.value) and "did you mean 'rollout.temperature'" in str(
        e.value
    )


def test_unknown_section_in_yaml(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollot:\n  n: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(f)


def test_bad_type_names_key_and_type():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.n=eight", "actor.use_kl_loss=3"])
    msg = str(e.value)
    assert "rollout.n" in msg and "expects int" in msg
    assert "actor.use_kl_loss" in msg and "expects bool" in msg


def test_a_group_estimator_with_one_sample_says_so_and_zero_samples_only_once():
    assert "rollout.n = 1: set rollout.n >= 2" in _problems(
        ["algorithm.adv_estimator=grpo", "rollout.n=1"]
    )
    problems = _problems(["algorithm.adv_estimator=grpo", "rollout.n=0"])
    assert "rollout.n = 0 must be >= 1" in problems and "rollout.n = 1" not in problems, problems


@pytest.mark.parametrize("value", [0, -3])
def test_no_rollout_slot_is_named_at_validate(value):
    assert f"rollout.max_num_seqs = {value} must be >= 1" in _problems(
        [f"rollout.max_num_seqs={value}"]
    )


def test_types_coerced():
    cfg = load_config(
        None, ["actor.lr=1", "data.train_files=a.parquet", "actor.max_tokens_per_gpu=null"]
    )
    assert isinstance(cfg.actor.lr, float)
    assert cfg.data.train_files == ["a.parquet"]
    assert cfg.actor.max_tokens_per_gpu is None


def test_indivisible_train_batch_names_the_multiple_to_use():
    msg = _problems(
        [
            "data.train_batch_size=60",
            "rollout.n=12",
            "trainer.n_gpus_per_node=64",
            "trainer.backend=local",
        ]
    )
    # 60 × 12 = 720 samples over 64 ranks: need train_batch_size multiple of 64 / gcd(12, 64) = 16
    assert "data.train_batch_size × rollout.n = 60 × 12 = 720" in msg
    assert "make data.train_batch_size a multiple of 16" in msg


def test_all_problems_reported_at_once():
    msg = _problems(["actor.ppo_epochs=0", "rollout.top_p=1.5", "algorithm.adv_estimator=grpoo"])
    assert "actor.ppo_epochs = 0" in msg
    assert "rollout.top_p = 1.5" in msg
    assert "did you mean 'grpo'" in msg


def test_mini_batch_rules():
    msg = _problems(["data.train_batch_size=32", "actor.ppo_mini_batch_size=12"])
    assert "not a multiple of actor.ppo_mini_batch_size = 12" in msg
    msg = _problems(["data.train_batch_size=32", "actor.ppo_mini_batch_size=64"])
    assert "actor.ppo_mini_batch_size = 64 must be between 1 and data.train_batch_size = 32" in msg


def test_mini_batch_split_over_ranks():
    msg = _problems(
        [
            "trainer.backend=local",
            "trainer.n_gpus_per_node=8",
            "rollout.n=2",
            "data.train_batch_size=32",
            "actor.ppo_mini_batch_size=2",
            "actor.micro_batch_size_per_gpu=1",
        ]
    )
    # 2 × 2 = 4 samples over 8 ranks: need a multiple of 8 / gcd(2, 8) = 4
    assert "actor.ppo_mini_batch_size × rollout.n = 2 × 2 = 4" in msg
    assert "multiple of 4" in msg


def test_micro_batch_divides_mini_batch():
    msg = _problems(
        ["rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=3"]
    )
    assert "= 16 samples is not a multiple of actor.micro_batch_size_per_gpu = 3" in msg


def test_token_budget_vs_lengths():
    msg = _problems(
        [
            "data.max_prompt_length=100",
            "data.max_response_length=50",
            "actor.max_tokens_per_gpu=120",
        ]
    )
    assert "actor.max_tokens_per_gpu = 120" in msg and "= 150" in msg


def test_group_estimator_needs_n_ge_2():
    msg = _problems(["rollout.n=1", "algorithm.adv_estimator=rloo"])
    assert "rollout.n >= 2" in msg
    validate(load_config(None, ["rollout.n=1", "algorithm.adv_estimator=gae"]))


def test_unknown_loss_and_agg_names():
    msg = _problems(["actor.policy_loss=vanila", "actor.loss_agg_mode=token_mean"])
    assert "actor.policy_loss = 'vanila'" in msg and "'vanilla'" in msg
    assert "actor.loss_agg_mode" in msg


def test_lengths_within_model_context(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    msg = _problems(
        [f"model.path={tmp_path}", "data.max_prompt_length=60", "data.max_response_length=10"]
    )
    assert "exceeds the context" in msg and "(64 tokens)" in msg


def test_placement_and_backend():
    msg = _problems(["trainer.n_gpus_per_node=4"])
    assert "trainer.backend = inprocess" in msg
    msg = _problems(["trainer.backend=local", "trainer.nnodes=2"])
    assert "trainer.backend=ray" in msg
    msg = _problems(
        [
            "trainer.backend=local",
            "trainer.n_gpus_per_node=4",
            "trainer.placement=split",
            "trainer.rollout_gpus=4",
        ]
    )
    assert "trainer.rollout_gpus" in msg
    with pytest.raises(ConfigError, match="this node has 2 GPU"):
        validate(
            load_config(
                None, ["trainer.backend=local", "trainer.n_gpus_per_node=4", "trainer.device=cuda"]
            ),
            gpus_available=2,
        )


def test_derived_sizes():
    cfg = load_config(
        None,
        [
            "trainer.backend=local",
            "trainer.n_gpus_per_node=4",
            "data.train_batch_size=32",
            "rollout.n=8",
            "actor.ppo_mini_batch_size=8",
            "actor.micro_batch_size_per_gpu=4",
        ],
    )
    d = validate(cfg)
    assert d.samples_per_step == 256
    assert d.mini_batches_per_step == 4
    assert d.mini_batch_samples_per_gpu == 8 * 8 // 4
    assert d.micro_batches_per_mini_batch == 4


def test_every_field_documented():
    import dataclasses

    cfg = Config()
    for section in dataclasses.fields(Config):
        cls = type(getattr(cfg, section.name))
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
        assert not missing, f"{section.name}: fields without a docstring: {missing}"


def test_rollout_engine_options_from_yaml_and_dotted_overrides(tmp_path):
    """rollout.engine.* maps onto EngineOptions: nested YAML and three-part overrides, the
    override winning; the default object is not shared between configs."""
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  engine:\n    decode_layer: chain\n    steps_per_sync: 4\n")
    cfg = load_config(f, ["rollout.engine.decode_layer=split", "rollout.engine.pdl=false",
                          "rollout.engine.retune=true"])  # fmt: skip
    engine = cfg.rollout.engine
    assert (engine.decode_layer, engine.steps_per_sync, engine.pdl, engine.retune) == (
        "split", 4, False, True)  # fmt: skip
    assert Config().rollout.engine.decode_layer == "auto"
    validate(cfg)


def test_rollout_engine_problems_are_named():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.engine.decode_layr=split", "rollout.engine.steps_per_sync=x"])
    text = str(e.value)
    assert (
        "rollout.engine.decode_layr" in text
        and "did you mean 'rollout.engine.decode_layer'" in text
    )
    assert "rollout.engine.steps_per_sync" in text and "expects int" in text
    text = _problems(["rollout.engine.decode_layer=fast", "rollout.engine.sync_lag=3",
                      "rollout.engine.service_stream=own"])  # fmt: skip
    assert "rollout.engine.decode_layer='fast'" in text and "rollout.engine.sync_lag=3" in text
    assert "rollout.engine.service_stream='own'" in text
    with pytest.raises(ConfigError, match="section.group.key"):
        load_config(None, ["rollout.engine.a.b=1"])


def test_fp8_rollout_needs_a_gpu_and_a_layer_that_reads_fp8():
    with pytest.raises(ConfigError, match=r"rollout.dtype = 'int8' must be model or fp8"):
        validate(load_config(None, ["rollout.dtype=int8"]))
    with pytest.raises(ConfigError, match=r"rollout.dtype = fp8 needs a GPU"):
        validate(load_config(None, ["rollout.dtype=fp8", "trainer.device=cpu"]))
    with pytest.raises(ConfigError, match=r"rollout.dtype = fp8: rollout.engine.weight_format"):
        validate(load_config(None, ["rollout.dtype=fp8", "trainer.device=cuda",
                                    "rollout.engine.decode_layer=chain"]))  # fmt: skip
    validate(load_config(None, ["rollout.dtype=fp8", "trainer.device=cuda"]))


def test_fp8_rollout_turns_truncated_importance_sampling_on_unless_set():
    from hybridflow.trainer.lifecycle.run import async_defaults

    said = []
    cfg = async_defaults(load_config(None, ["rollout.dtype=fp8"]), said.append)
    assert cfg.actor.rollout_is_cap == 2.0 and "fp8" in said[0]
    kept = async_defaults(load_config(None, ["rollout.dtype=fp8", "actor.rollout_is_cap=5"]),
                          said.append)  # fmt: skip
    assert kept.actor.rollout_is_cap == 5 and len(said) == 1
    assert async_defaults(load_config(None, []), said.append).actor.rollout_is_cap is None


def test_fp8_rollout_reaches_the_engine_options():
    from hybridflow.workers.rollout import engine_options

    assert engine_options(load_config(None, ["rollout.dtype=fp8"])).weight_format == "fp8"
    assert engine_options(load_config(None, [])).weight_format == "model"


def test_fp8_training_with_an_fp8_rollout_validates_and_the_rollout_takes_the_actors_recipe():
    from hybridflow.workers.rollout import engine_options

    for recipe in ("rowwise", "tensorwise"):
        cfg = load_config(None, ["model.path=tiny", "trainer.device=cuda", "actor.precision=fp8",
                                 f"actor.fp8_recipe={recipe}", "rollout.dtype=fp8"])  # fmt: skip
        validate(cfg)
        options = engine_options(cfg)
        assert options.weight_format == "fp8" and options.fp8_weight_scales == recipe
    chosen = load_config(None, ["actor.precision=fp8", "rollout.dtype=fp8",
                                "rollout.engine.fp8_weight_scales=engine"])  # fmt: skip
    assert engine_options(chosen).fp8_weight_scales == "engine"  # set by hand: kept
    # bf16 training: the engine's own scales ("auto" resolves to them in the engine)
    assert engine_options(load_config(None, ["rollout.dtype=fp8"])).fp8_weight_scales == "auto"
    # the rollout's dtype does not follow actor.precision (docs/fp8-training.md says why)
    assert engine_options(load_config(None, ["actor.precision=fp8"])).weight_format == "model"
    with pytest.raises(ConfigError, match=r"rollout.engine.fp8_weight_scales='blockwise'"):
        validate(load_config(None, ["rollout.dtype=fp8", "trainer.device=cuda",
                                    "rollout.engine.fp8_weight_scales=blockwise"]))  # fmt: skip


def test_optimizer_offload_on_several_training_ranks_names_param_offload():
    msg = _problems(
        ["trainer.backend=local", "trainer.n_gpus_per_node=2", "actor.optimizer_offload=true"]
    )
    assert "actor.optimizer_offload = true" in msg and "on 2 ranks (FSDP2)" in msg
    assert "actor.param_offload=true" in msg
    # one training GPU beside the rollout's (split placement): no FSDP, no problem
    validate(load_config(None, ["trainer.backend=local", "trainer.n_gpus_per_node=2",
                                "trainer.placement=split", "trainer.rollout_gpus=1",
                                "actor.optimizer_offload=true"]))  # fmt: skip


@pytest.mark.parametrize(
    "overrides, named",
    [([], "model.lora_rank > 0"),
     (["model.lora_rank=8", "trainer.device=cuda"], "the base weights in the rollout's dtype: model.dtype = bfloat16"),
     (["model.lora_rank=8", "trainer.mode=async", "trainer.max_staleness=1"],
      "no generation over an update"),
     (["model.lora_rank=8", "trainer.backend=local", "trainer.n_gpus_per_node=2"], "one device")],
)  # fmt: skip
def test_lora_in_place_names_what_it_needs(overrides, named):
    cfg = load_config(None, ["rollout.lora_in_place=true", *overrides])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert f"rollout.lora_in_place = true needs {named}" in str(error.value)
    ok = load_config(
        None, ["rollout.lora_in_place=true", "model.lora_rank=8", "trainer.device=cpu"]
    )
    validate(ok)


@pytest.mark.parametrize("given", ["off", "no", "false"])
def test_off_given_to_a_text_setting_is_the_text_off_not_a_boolean(given, tmp_path):
    # YAML 1.1 reads `off` as False: `actor.router_replay=off` was refused ("expects str")
    assert load_config(None, [f"actor.router_replay={given}"]).actor.router_replay == "off"
    path = tmp_path / "run.yaml"
    path.write_text(f"actor:\n  router_replay: {given}\n")
    assert load_config(path, []).actor.router_replay == "off"


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.temperature=inf", "rollout.temperature = inf must be within [1e-06, 10000]"),
        ("rollout.val_temperature=1e300", "rollout.val_temperature = 1e+300 must be within"),
        ("model.lora_dropout=inf", "model.lora_dropout = inf must be in [0, 1)"),
        ("model.lora_dropout=1", "model.lora_dropout = 1.0 must be in [0, 1)"),
        ("algorithm.gamma=nan", "algorithm.gamma (command line) = nan: give a number"),
        ("rollout.temperature=nan", "rollout.temperature (command line) = nan: give a number"),
        # made in memory before the run: 10**30 of them grew without bound
        (
            "data.builtin_train_size=1000000000000",
            "data.builtin_train_size = 1000000000000 must be at most 1,000,000",
        ),
        ("data.builtin_val_size=2000000", "data.builtin_val_size = 2000000 must be at most"),
        ("sft.eval_size=1000000000000", "sft.eval_size = 1000000000000 must be at most"),
        # whole numbers reach torch as int64: an OverflowError traceback in train
        (
            "rollout.top_k=1000000000000000000000000000000",
            "rollout.top_k (command line) = 1000000000000000000000000000000 is past the largest",
        ),
        ("trainer.seed=-9223372036854775809", "trainer.seed (command line) = -9223372036854775809"),
    ],
)
def test_a_number_the_run_cannot_use_is_named_at_validate(override, words):
    """Each passed validate; train then stopped in a traceback (the sampler's or dropout's
    check), or, for nan, compared false to every bound and ran on."""
    with pytest.raises(ConfigError) as error:
        validate(load_config(None, [override]))
    assert words in str(error.value)
