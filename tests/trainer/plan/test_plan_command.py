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
    # NaN is no number at all, refused as the config is read; the others are out of range
    expected = "= nan: give a number" if value == "nan" else "at most 1048576"
    assert "trainer.gpu_memory_gib" in err and expected in err, err


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


@pytest.fixture
def plenty_of_host(monkeypatch):
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**50, "test"))


def planned(overrides: list[str], gpu_memory: str) -> str:
    """What `config plan` prints, whether or not the configured layout fits."""
    out = []
    try:
        plan_command(load_config(None, overrides), gpu_memory, out=out.append)
    except ConfigError:
        pass
    return "\n".join(out)


def test_one_plan_is_printed_with_the_layout_it_recommends(plenty_of_host):
    """Llama-3.1-70B on 8 × 80 GiB: one table (the plan validate and train check), and the
    layout that fits it: the actor's state on the host, rollout tp 8."""
    text = planned([*LLAMA70_GRPO, "trainer.device=cuda"], "80GiB")
    assert text.count("memory plan: llama3.1-70b") == 1 and text.count("  item ") == 1
    assert "layout: actor tp 1 · sp 1 · ep 1 (data parallel 8) on 8 GPU(s)" in text
    assert ("recommended layout: rollout.tensor_parallel_size=8 model.gradient_checkpointing=true "
            "actor.param_offload=true (peak ") in text  # fmt: skip


def test_a_tensor_parallel_layout_is_planned(plenty_of_host):
    text = planned([*LLAMA70_GRPO, "trainer.device=cuda", "actor.tensor_parallel_size=2",
                    "rollout.tensor_parallel_size=8", "actor.param_offload=true",
                    "model.gradient_checkpointing=true"], "80GiB")  # fmt: skip
    assert (
        "layout: actor tp 2 · sp 1 · ep 1 (data parallel 4) on 8 GPU(s), rollout tp 8 (1 replica)"
        in text
    )
    assert "rollout weights (bf16 copy)" in text and "1/8, tensor parallel" in text
    assert "GPU 80.0 GiB (--gpu-memory), 75.0 GiB usable: fits" in text
    # it fits, and the plan prefers less model parallelism where that fits too
    assert "recommended layout: actor.tensor_parallel_size=1 (peak " in text
    # both layouts have their code path (models/sharding/tensor_parallel.py, engine/tensor_parallel.py)
    assert "not yet supported" not in text


def test_the_reshard_line_is_the_block_plans_bytes_for_a_dense_model(plenty_of_host):
    """FSDP2 over 8 GPUs into a rollout of TP 8: 4.9 GiB into each GPU a sync (the row-parallel
    weights and the norms; tests/parallel/test_blocks.py has the arithmetic), not the 14.4 of
    the shard less its 1/8."""
    text = planned([*LLAMA70_GRPO, "rollout.tensor_parallel_size=8", "actor.param_offload=true",
                    "model.gradient_checkpointing=true"], "140GiB")  # fmt: skip
    assert "reshard: 4.9 GiB into each rollout GPU a sync" in text


def test_deepseek_v3_is_planned_and_validated_as_a_preset_of_the_runtime(plenty_of_host):
    overrides = ["model.path=deepseek-v3", "trainer.backend=ray", "trainer.nnodes=12",
                 "trainer.n_gpus_per_node=8", "data.train_batch_size=96",
                 "actor.ppo_mini_batch_size=24", "data.max_prompt_length=1024",
                 "data.max_response_length=4096", "rollout.n=8", "trainer.device=cuda",
                 "actor.max_tokens_per_gpu=16384", "rollout.max_num_seqs=256",
                 "actor.tensor_parallel_size=8", "actor.expert_parallel_size=4",
                 "actor.param_offload=true", "model.gradient_checkpointing=true"]  # fmt: skip
    text = planned(overrides, "96GB")
    assert text.startswith("memory plan: deepseek-v3 (671.03 B parameters")
    assert "not yet supported, so hybridflow train refuses" not in text  # tp/ep are built...
    with pytest.raises(ConfigError) as error:  # ...but not tp of experts
        validate(load_config(None, overrides))
    assert not any("deepseek-v3:" in p for p in error.value.problems)
    assert any(p.startswith("actor: actor.tensor_parallel_size = 8") for p in error.value.problems)


def test_when_nothing_fits_the_plan_says_what_fills_the_closest(plenty_of_host):
    """Qwen3-235B-A22B on 4 × 80 GiB: its 4 KV heads stop the rollout at tp 4, one replica, so
    each GPU would hold a quarter of the model."""
    text = planned(["model.path=qwen3-235b-a22b", "trainer.backend=ray",
                    "trainer.n_gpus_per_node=4", "trainer.device=cuda"], "80GiB")  # fmt: skip
    line = next(line for line in text.splitlines() if "no layout fits" in line)
    assert "rollout.tensor_parallel_size=4" in line and "rollout weights (bf16 copy)" in line


def test_experts_over_rollout_replicas_make_qwen3_235b_fit_32_gpus(plenty_of_host):
    """Qwen3-235B-A22B on 32 × 80 GiB (short sequences): the rollout's experts spread over
    16 of its replicas of one GPU (engine/expert_spread.py) and the actor's expert shards
    offloaded fit, where the rollout's tp stops at 4 (4 KV heads, a quarter of the model a
    GPU)."""
    text = planned(["model.path=qwen3-235b-a22b", "trainer.nnodes=4", "trainer.backend=ray",
                    "trainer.n_gpus_per_node=8", "trainer.device=cuda"], "80GiB")  # fmt: skip
    line = next(line for line in text.splitlines() if "recommended layout" in line)
    assert "rollout.expert_parallel_size=16" in line and "actor.param_offload=true" in line


def test_the_reshard_line_of_a_mixture_of_experts_counts_each_ranks_experts():
    """tiny-moe colocated on 2 devices into rollout TP 2: with the experts split, FSDP2's
    row chunks are each rank's experts and never move; held whole (expert_parallel_size=1)
    each rank also receives the other half: 3 sparse layers × 4 experts × (256 + 128) × 128
    elements × 2 bytes (the plan's bf16 rollout copy) = 1,179,648 bytes more."""
    from hybridflow.trainer.plan.memory_from_config import plan_for_config
    from hybridflow.trainer.plan.parallel_section import sync_bytes

    def received(*extra: str) -> int:
        cfg = load_config(None, ["model.path=tiny-moe", "trainer.backend=local", "trainer.device=cpu",
                                 "trainer.n_gpus_per_node=2", "rollout.tensor_parallel_size=2",
                                 *extra])  # fmt: skip
        return sync_bytes(cfg, plan_for_config(cfg, validate(cfg), 2**30))

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


def test_a_quantized_checkpoint_is_validated_and_planned_dequantised(tmp_path, capsys):
    """Its weights load dequantised: validate accepts it (it refused it before the loader
    read it) and the plan says it counts them so."""
    from hybridflow.cli import main
    from tests.models.mla_moe_helpers import deepseek_transformers, edit_config
    from tests.models.quantized_helpers import fp8_blocks

    deepseek_transformers().save_pretrained(tmp_path / "fp8")
    edit_config(tmp_path / "fp8", max_position_embeddings=64)  # the default prompts fit
    fp8_blocks(tmp_path / "fp8", tmp_path / "plain", (16, 16))
    overrides = [f"model.path={tmp_path / 'fp8'}", "model.tokenizer_path=char",
                 "trainer.device=cpu"]  # fmt: skip
    assert main(["config", "validate", *overrides]) == 0
    assert main(["config", "plan", *overrides]) == 0
    out = capsys.readouterr().out
    assert "model.path stores its weights as fp8; they load dequantised" in out
    assert main(["config", "plan", *overrides[1:], f"model.path={tmp_path / 'plain'}"]) == 0
    assert "dequantised" not in capsys.readouterr().out


def test_deepseek_v3_fits_96_gpus_of_96_gb_with_the_rollouts_copy_freed_for_the_update():
    """docs/parallelism.md, The plan at scale: actor ep 32 with its state on the host, the
    rollout's experts over 32 replicas. Its 69.9 GiB copy held through the update put that at
    130.0 GiB; freed, the update is 60.0 GiB and generation (the copy, the workspace and the
    reference's 13.0 GiB shard, 95.7) the fullest phase; the reference on the host too, it
    fits: 82.7 GiB before the KV cache, 87.5 with it, the update 47.0; in replicas of rollout
    TP 2 it fits with the reference's shard on the GPU."""
    from hybridflow.trainer.plan.memory_fixes import fits
    from hybridflow.trainer.plan.memory_from_config import plan_for_config
    from hybridflow.trainer.plan.memory_plan import GENERATE, UPDATE

    base = [
        "model.path=deepseek-v3", "trainer.backend=ray", "trainer.nnodes=12",
        "trainer.n_gpus_per_node=8", "trainer.device=cuda", "data.train_batch_size=96",
        "actor.ppo_mini_batch_size=24", "data.max_prompt_length=1024",
        "data.max_response_length=4096", "rollout.n=8", "actor.max_tokens_per_gpu=16384",
        "rollout.max_num_seqs=256", "rollout.gpu_memory_utilization=0.9",
        "actor.use_kl_loss=true", "actor.expert_parallel_size=32",
        "model.gradient_checkpointing=true", "actor.param_offload=true",
        "rollout.expert_parallel_size=32"]  # fmt: skip

    def planned(*overrides: str):
        cfg = load_config(None, [*base, *overrides])
        plan = plan_for_config(cfg, validate(cfg), 96 * 10**9)
        gib = {phase: round(plan.phase_bytes(phase) / GIB, 1) for phase in (GENERATE, UPDATE)}
        return plan, gib

    held, gib = planned()
    assert gib[UPDATE] == 130.0 and not fits(held)
    freed, gib = planned("rollout.release_weights=true")
    assert (gib[GENERATE], gib[UPDATE]) == (95.7, 60.0) and not fits(freed)
    both, gib = planned("rollout.release_weights=true", "ref.param_offload=true")
    assert (gib[GENERATE], gib[UPDATE]) == (87.5, 47.0) and fits(both)
    assert round(both.checked_peak()[1] / GIB, 1) == 82.7 and both.kv_slots == 14
    # replicas of rollout TP 2 (MLA split by heads, the latent whole on each rank): a 55.0
    # GiB copy, 115.0 GiB in the update if held; freed, it fits with the reference on the
    # GPU, 26 sequences a replica (the layout `config plan` recommends: docs/parallelism.md)
    tp2 = "rollout.tensor_parallel_size=2"
    held, gib = planned(tp2)
    assert gib[UPDATE] == 115.0 and not fits(held)
    (copy,) = [i.gpu_bytes for i in held.items if i.name.startswith("rollout weights")]
    assert round(copy / GIB, 1) == 55.0
    freed, gib = planned(tp2, "rollout.release_weights=true")
    assert (gib[GENERATE], gib[UPDATE]) == (87.3, 60.0) and fits(freed) and freed.kv_slots == 26


def test_the_plans_long_parts_are_reported_as_they_go(plenty_of_host):
    """What a sync moves (block by block) and the search for the layout to recommend take
    seconds at scale: `config plan` reports both on its progress reporter (stderr)."""
    from progress_helpers import recording_reporter

    reporter, buffer, opened = recording_reporter()
    cfg = load_config(None, [*LLAMA70_GRPO, "trainer.device=cuda"])
    with pytest.raises(ConfigError):  # the configured layout does not fit; one is recommended
        plan_command(cfg, "80GiB", out=[].append, progress=reporter)
    reporter.close()
    assert opened == [
        "config plan: what a weight sync moves",
        "config plan: the layout to recommend",
    ]
    assert "config plan: the layout to recommend: done, " in buffer.getvalue()


def test_a_window_past_the_rollouts_length_is_validated_and_planned_as_its_ring(tmp_path, capsys):
    """GPT-OSS whose sliding_window (2**31 - 1) no 32 + 16-token sequence fills: validate and
    the plan accept it (they refused the 2**31 - 1-position rings of a CPU rollout's 1,024
    slots, naming rollout.max_num_seqs), its KV cache priced as that of a 48-token window."""
    from hybridflow.cli import main
    from hybridflow.trainer.plan.memory_from_config import plan_for_config
    from tests.models.mla_moe_helpers import edit_config, gpt_oss_transformers

    gpt_oss_transformers(sliding_window=2**31 - 1).save_pretrained(tmp_path / "wide")
    gpt_oss_transformers(sliding_window=48).save_pretrained(tmp_path / "as_long")
    rest = ["model.tokenizer_path=char", "trainer.device=cpu"]
    overrides = [f"model.path={tmp_path / 'wide'}", *rest]
    assert main(["config", "validate", *overrides]) == 0
    assert main(["config", "plan", *overrides]) == 0
    assert "window rings of 1,025 slots" in capsys.readouterr().out

    def kv_item(path):
        plan = plan_for_config(load_config(None, [f"model.path={path}", *rest]))
        return next(item for item in plan.items if item.name.startswith("KV cache"))

    assert kv_item(tmp_path / "wide") == kv_item(tmp_path / "as_long")
    edit_config(tmp_path / "as_long", sliding_window=4)  # a ring shorter than the sequence
    assert kv_item(tmp_path / "as_long").gpu_bytes < kv_item(tmp_path / "wide").gpu_bytes


@pytest.mark.parametrize(
    "make_path, expected",
    [(lambda tmp: "qwen3.5-27x", "is not a directory, a preset (tiny"),
     (lambda tmp: str(tmp), "no config.json there"),
     (lambda tmp: (tmp / "config.json").write_text('{"model_type": "bert"}') and str(tmp),
      "its config.json gives no shape to plan (KeyError")],
)  # fmt: skip
def test_a_model_path_without_a_shape_is_refused_with_its_reason(make_path, expected, tmp_path,
                                                                 capsys):  # fmt: skip
    from hybridflow.cli import main

    status = main(["config", "plan", f"model.path={make_path(tmp_path)}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert expected in err, err
