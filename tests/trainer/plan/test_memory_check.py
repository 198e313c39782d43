"""The memory plan from a config: `hybridflow config plan`, and `train` / `config validate`
stopping with exit 2 before any model loads when the run cannot fit."""

import pytest

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config, validate
from hybridflow.trainer.plan import memory_check as mc
from hybridflow.trainer.plan import memory_fixes as mf
from hybridflow.trainer.plan import memory_from_config as mfc
from hybridflow.trainer.plan.memory_plan import GIB


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the memory check must come first."""

    def loaded(*args, **kwargs):
        pytest.fail("a model was loaded before the memory check")

    import hybridflow.models as models
    import hybridflow.workers.model_loading as model_loading

    monkeypatch.setattr(models, "load_model", loaded)
    monkeypatch.setattr(models, "build_model", loaded)
    monkeypatch.setattr(model_loading, "load_causal_lm", loaded)


FULL_32B = ["model.path=qwen2.5-32b", "trainer.gpu_memory_gib=80", "trainer.run_dir=RUN"]


@pytest.mark.parametrize("command", [["train"], ["config", "validate"]])
def test_a_32b_full_fine_tune_on_an_80gib_gpu_exits_2_before_loading(
    command, no_model_loads, tmp_path, capsys
):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in FULL_32B]
    assert main([*command, *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "qwen2.5-32b does not fit on a 80.0 GiB GPU (trainer.gpu_memory_gib)" in err
    # 32.76 B parameters: AdamW 8 bytes each (244 GiB), fp32 masters and gradients 4 each
    assert "optimizer state (AdamW, fp32) 244.1 GiB" in err
    assert "actor weights (fp32 masters) 122.1 GiB" in err
    # each fix planned again (checkpointed: model.gradient_checkpointing=auto turns it on for
    # an update this size): LoRA alone keeps fp32 base weights (122 GiB), too big; its
    # 537 M fp32 adapter parameters add 2.0 GiB of their own
    assert "model.lora_rank=64 (peak 251.1 GiB in the actor update, too big)" in err
    assert "actor.optimizer_offload=true (peak" in err and "model.dtype=bfloat16 (peak" in err
    # and together: with the masters and AdamW on the host, the GPU still holds the bf16
    # weights (61 GiB) and their bf16 gradients
    assert "Together they do not fit either" in err
    assert "actor weights (bf16, masters on the host) 61.0 GiB" in err
    assert "actor gradients (bf16) 61.0 GiB" in err
    assert not (tmp_path / "run").exists()


def test_the_named_combination_does_fit():
    # checkpointing off by hand (auto would turn it on), so that a fix can name it
    cfg = load_config(None, ["model.path=qwen2.5-7b", "trainer.gpu_memory_gib=35",
                             "model.gradient_checkpointing=false"])  # fmt: skip
    plan = mfc.plan_for_config(cfg, validate(cfg), 35 * GIB)
    text = mf.fixes_text(cfg, plan)
    assert "Together: actor.optimizer_offload=true model.gradient_checkpointing=true" in text
    together = text.split("Together: ")[1].split(" (peak")[0].split()
    fixed = load_config(None, ["model.path=qwen2.5-7b", *together])
    assert mf.fits(mfc.plan_for_config(fixed, validate(fixed), 35 * GIB))


def test_a_7b_that_fits_with_lora_says_so(capsys):
    status = main(["config", "plan", "model.path=qwen2.5-7b", "--gpu-memory", "80GiB"])
    out, err = capsys.readouterr()
    assert status == 2
    assert "actor weights (fp32 masters)" in out and "does NOT fit" in out
    assert "model.lora_rank=64 (peak" in err and "fits)" in err


def test_plan_without_a_gpu_prints_and_does_not_check(capsys, monkeypatch):
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (2**50, "test"))
    assert main(["config", "plan", "model.path=qwen2.5-7b", "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    # max_num_seqs: free memory unknown; 48 tokens a sequence, one 64-token block each
    assert "KV cache (1,024 + 1 blocks: 1,024 × 48 tokens)" in out
    assert "fit not checked" in out
    assert "host: a step's data" in out and "fits" in out.splitlines()[-1]


def test_a_cpu_run_of_a_7b_model_does_not_fit_16_gib_of_host(capsys, monkeypatch):
    from hybridflow.trainer.plan import host_memory

    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: (16 * 2**30, "test"))
    assert main(["config", "plan", "model.path=qwen2.5-7b", "trainer.device=cpu"]) == 2
    captured = capsys.readouterr()
    assert "host memory, 16.0 GiB is free (test)" in captured.err
    assert "does NOT fit" in captured.out


def test_a_fitting_run_passes_and_the_plan_is_printed(capsys):
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", "trainer.gpu_memory_gib=141"])
    lines = []
    plan = mc.check_memory(cfg, validate(cfg), log=lines.append)
    assert plan is not None and mf.fits(plan)
    assert "fits, peak" in lines[0] and "141.0 GiB (trainer.gpu_memory_gib)" in lines[0]


def test_a_cpu_run_is_not_planned():
    cfg = load_config(None, ["trainer.device=cpu"])
    assert mc.check_memory(cfg, validate(cfg)) is None


NO_KV_ROOM = ["model.path=qwen2.5-0.5b", "rollout.gpu_memory_utilization=0.01",
              "data.max_response_length=4000", "trainer.gpu_memory_gib=24",
              "actor.micro_batch_size_per_gpu=1", "model.gradient_checkpointing=true"]  # fmt: skip


def test_no_room_for_one_sequences_kv_blocks_names_the_utilization():
    with pytest.raises(ConfigError) as error:
        cfg = load_config(None, NO_KV_ROOM)
        mc.check_memory(cfg, validate(cfg))
    text = str(error.value)
    # 48 + 4000 tokens: 63 blocks of 64 (24 layers · 2 kv heads · 64 · 2 · 2 bytes a token)
    assert "rollout.gpu_memory_utilization = 0.01" in text
    assert "fewer than the 63 KV-cache blocks of 64 tokens (47 MiB) that one sequence" in text
    assert "rollout.gpu_memory_utilization=0.9 (peak" in text and "no sequence's KV blocks" in text


def test_validate_prices_an_fp8_kv_caches_blocks_at_a_byte_an_element_and_its_scales():
    """rollout.engine.kv_cache_dtype=fp8: 24 layers · 2 kv heads · 2 · (64 + 4) bytes a
    token, 63 blocks of 64: 25 MiB where bf16 takes 47."""
    with pytest.raises(ConfigError) as error:
        cfg = load_config(None, [*NO_KV_ROOM, "rollout.engine.kv_cache_dtype=fp8"])
        mc.check_memory(cfg, validate(cfg))
    assert "fewer than the 63 KV-cache blocks of 64 tokens (25 MiB) that one" in str(error.value)


def test_no_kv_slot_names_the_utilization():
    with pytest.raises(ConfigError) as error:  # the slot cache's own wording
        cfg = load_config(None, [*NO_KV_ROOM, "rollout.engine.kv_block_size=null"])
        mc.check_memory(cfg, validate(cfg))
    text = str(error.value)
    assert "rollout.gpu_memory_utilization = 0.01" in text and "holds no KV-cache slot" in text
    assert "rollout.gpu_memory_utilization=0.9 (peak" in text and "no KV-cache slot)" in text


def test_a_bad_gpu_memory_names_the_flag(capsys):
    assert main(["config", "plan", "--gpu-memory", "eighty"]) == 2
    assert "--gpu-memory 'eighty' is not a size" in capsys.readouterr().err


def test_plan_options_follow_the_config():
    cfg = load_config(
        None,
        ["model.path=qwen2.5-0.5b", "model.lora_rank=16", "actor.use_kl_loss=true",
         "actor.max_tokens_per_gpu=4096", "data.max_prompt_length=512",
         "data.max_response_length=512", "data.train_batch_size=16", "rollout.n=8",
         "actor.ppo_mini_batch_size=8"],
    )  # fmt: skip
    options = mfc.plan_options(cfg, validate(cfg), None)
    assert (options.master_bytes, options.rollout_bytes) == (4, 2)  # auto: fp32 masters
    assert options.reference == "actor"  # LoRA: the actor with its adapters off
    assert options.micro_batch_tokens == 4096
    # 8 prompts × 8 samples of up to 1024 tokens in 4096-token micro-batches: 16
    assert options.micro_batches == 16
    assert options.rollout_max_seq_len == 1024


@pytest.mark.parametrize(
    "mode, expected",
    [(["trainer.mode=sync"], False),
     (["trainer.mode=async", "trainer.max_staleness=0"], False),  # on-policy: generate, then train
     (["trainer.mode=async", "trainer.max_staleness=1"], True),
     (["trainer.mode=async", "trainer.max_staleness=0", "trainer.partial_rollout=true"], True)],
)  # fmt: skip
def test_async_generation_beside_the_update_plans_the_engines_own_weights(mode, expected):
    cfg = load_config(None, ["model.path=qwen2.5-0.5b", "model.dtype=bfloat16", *mode])
    options = mfc.plan_options(cfg, validate(cfg), None)
    assert options.rollout_beside_update is expected
    weights = {
        i.name: i.gpu_bytes for i in mfc.plan_for_config(cfg).items if "rollout weights" in i.name
    }
    # bf16 training weights: the engine reads them in place unless it generates over the update
    copy = mfc.plan_for_config(cfg).architecture.num_parameters() * 2
    assert sum(weights.values()) == (copy if expected else 0)


def test_an_explicit_log_prob_budget_that_cannot_fit_exits_2_naming_the_key(capsys):
    args = ["config", "plan", "model.path=qwen2.5-7b", "model.lora_rank=64", "--gpu-memory",
            "80GiB", "actor.log_prob_max_tokens_per_gpu=1000000"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "actor.log_prob_max_tokens_per_gpu = 1,000,000: a forward without autograd" in err
    # the largest the message names does fit: the same run with it passes
    most = err.split("set it to at most ")[1].split(", or leave")[0]
    ok = ["config", "plan", "model.path=qwen2.5-7b", "model.lora_rank=64", "--gpu-memory",
          "80GiB", f"actor.log_prob_max_tokens_per_gpu={most.replace(',', '')}"]  # fmt: skip
    assert main(ok) == 0
    args[-1] = f"actor.log_prob_max_tokens_per_gpu={int(most.replace(',', '')) + 1}"
    assert main(args) == 2


def test_lora_in_place_plans_no_rollout_copy_and_no_fused_copies():
    base = ["model.path=qwen2.5-32b", "model.lora_rank=64", "model.dtype=bfloat16"]
    copy, in_place = (mfc.plan_for_config(load_config(None, base + extra), None, 141 * GIB)
                      for extra in ([], ["rollout.lora_in_place=true"]))  # fmt: skip
    sizes = [{i.name: i.gpu_bytes for i in plan.items} for plan in (copy, in_place)]
    assert sizes[0]["rollout weights (bf16 copy)"] == copy.architecture.num_parameters() * 2
    assert sizes[1]["rollout weights"] == 0  # the actor's base, read in place
    assert sizes[0]["rollout fused q/k/v, gate/up copies"] > 0
    assert sizes[1]["rollout fused q/k/v, gate/up copies"] == 0  # the split layer reads in place
    assert not mf.fits(copy) and mf.fits(in_place)


def test_the_kv_cache_takes_most_of_the_memory_free_in_generation_by_default():
    """Llama-3.1-8B, 256 sequences of 4,096 tokens, AdamW on the host, one H200: the actor's
    and the reference's weights and the fused copies leave ~102 GiB free in generation; auto
    gives the cache 0.9 of it less the engine's workspace (177 full-length sequences), 0.4
    held 74."""
    recipe = ["model.path=llama3.1-8b", "data.train_batch_size=8", "rollout.n=32",
              "data.max_prompt_length=256", "data.max_response_length=3840",
              "rollout.max_num_seqs=256", "actor.ppo_mini_batch_size=8",
              "actor.optimizer_offload=true", "actor.use_kl_loss=true",
              "model.gradient_checkpointing=true", "actor.max_tokens_per_gpu=65536"]  # fmt: skip

    def plan(*overrides):
        cfg = load_config(None, [*recipe, *overrides])
        return mfc.plan_for_config(cfg, validate(cfg), 141 * GIB)

    assert plan().options.gpu_memory_utilization == 0.9 and plan().kv_slots == 177
    assert plan("rollout.gpu_memory_utilization=0.4").kv_slots == 74
    beside_update = plan("trainer.mode=async", "trainer.max_staleness=1")
    assert beside_update.options.gpu_memory_utilization == 0.4


def test_an_update_that_fits_without_the_rollouts_copy_names_release_weights():
    """Qwen3-30B-A3B on 8 × 80 GiB, experts over 8 ranks, rollout tp 4: the update is over
    by more than the rollout's copy; the fixes name freeing it, planned again (fits)."""
    cfg = load_config(None, ["model.path=qwen3-30b-a3b", "trainer.n_gpus_per_node=8",
                             "trainer.backend=local", "trainer.device=cuda",
                             "trainer.gpu_memory_gib=80", "actor.expert_parallel_size=8",
                             "rollout.tensor_parallel_size=4",
                             "model.gradient_checkpointing=true"])  # fmt: skip
    with pytest.raises(ConfigError) as error:
        mc.check_memory(cfg, validate(cfg))
    (problem,) = error.value.problems
    assert "rollout.release_weights=true (peak 73.5 GiB in the actor update, fits)" in problem
