"""model.gradient_checkpointing=auto and the log-prob passes' token budgets, by hand on the
0.5b and 7b shapes, and as the run resolves them from its config."""

import dataclasses

import pytest

from hybridflow.config import ConfigError, load_config, validate
from hybridflow.models.presets import PRESETS
from hybridflow.trainer.plan import memory_check as mc
from hybridflow.trainer.plan import memory_choices as choices
from hybridflow.trainer.plan import memory_from_config as mfc
from hybridflow.trainer.plan import memory_plan as mp
from hybridflow.trainer.plan.memory_plan import GIB, PlanOptions
from hybridflow.trainer.plan.memory_render import usable_bytes

QWEN05, QWEN7 = PRESETS["qwen2.5-0.5b"], PRESETS["qwen2.5-7b"]
P05, P7 = 494_032_768, 7_615_616_512  # parameters (test_memory_plan.py counts the 0.5b's)
# the 0.5b's bf16 compute copy: its layers' linear weights and the lm_head (tied embeddings)
COPY05 = 2 * (357_854_208 + 136_134_656)
# a 4096-token logits chunk: bf16 logits + fp32 copy + fp32 probabilities, 10 bytes a logit
LOGITS05, LOGITS7 = 4096 * 151_936 * 10, 4096 * 152_064 * 10


def test_forward_per_token_bytes_by_hand():
    # 0.5b: one layer's 4h + 2q + 2kv + 4i = 3584 + 1792 + 256 + 19456 = 25,088 elements,
    # + the residual stream and the head's 3h (4 · 896) = 28,672, bf16: 57,344 bytes
    assert choices.forward_bytes_per_token(QWEN05) == 57_344
    # 7b: 4·3584 + 2·3584 + 2·512 + 4·18944 = 98,304, + 4·3584 = 112,640 elements
    assert choices.forward_bytes_per_token(QWEN7) == 225_280
    # 40x below what the update keeps a token (1,209,600 bytes for the 0.5b): no autograd
    assert mp.activation_bytes_per_token(QWEN05, False) == 1_209_600
    assert choices.forward_bytes(QWEN05, 100) == 100 * 57_344 + 100 * 151_936 * 10


def test_the_0_5b_budget_is_what_fits_beside_its_resident_weights_on_a_16_gib_gpu():
    options = PlanOptions(micro_batch_tokens=8192, gpu_bytes=16 * GIB)
    plan = mp.build_plan("qwen2.5-0.5b", QWEN05, options)
    # resident: fp32 masters (4P) + AdamW (8P) + the rollout's bf16 copy (2P) + the compute
    # copy autocast keeps for the forward; not the gradients nor the update's activations
    resident = 14 * P05 + COPY05
    assert choices.forward_resident_bytes(plan) == resident == 7_904_436_480
    usable = int(16 * GIB * 0.95) - GIB
    assert usable == usable_bytes(16 * GIB) == 15_247_133_900
    # (15,247,133,900 - 7,904,436,480 - 6,223,298,560) // 57,344 = 19,520 -> 19 × 1024
    assert (usable - resident - LOGITS05) // 57_344 == 19_520
    assert choices.forward_token_budget(plan, 8192, batch_tokens=10**6) == 19_456
    # the cap: 4 × the update's budget, and at most the batch on one GPU
    assert choices.forward_token_budget(plan, 4096, batch_tokens=10**6) == 16_384
    assert choices.forward_token_budget(plan, 4096, batch_tokens=10_000) == 10_000
    # never below the update's own budget (its activations are the larger ones)
    assert choices.forward_token_budget(plan, 32_768, batch_tokens=10**6) == 32_768


def test_the_7b_budget_on_an_h200():
    options = PlanOptions(micro_batch_tokens=16384, optimizer_offload=True, reference="own",
                          gpu_bytes=141 * GIB)  # fmt: skip
    plan = mp.build_plan("qwen2.5-7b", QWEN7, options)
    # bf16 weights on the GPU (masters and AdamW on the host) and the bf16 reference; the
    # rollout reads the actor's weights in place and autocast has nothing to cast
    assert choices.forward_resident_bytes(plan) == 2 * P7 + 2 * P7 == 30_462_466_048
    # (142,753,975,500 - 30,462,466,048 - 6,228,541,440) // 225,280 = 470,805 tokens fit:
    # the cap decides, 4 × 16,384
    fitting = (usable_bytes(141 * GIB) - 4 * P7 - LOGITS7) // 225_280
    assert fitting == 470_805
    assert choices.forward_token_budget(plan, 16384, batch_tokens=10**6) == 65_536
    # a full fine-tune on an 80 GiB GPU: fp32 masters, AdamW, compute and rollout copies
    # (112 GiB) exceed it already; the budget stays the update's (the fit check says why)
    full = mp.build_plan("qwen2.5-7b", QWEN7, PlanOptions(micro_batch_tokens=4096,
                                                          gpu_bytes=80 * GIB))  # fmt: skip
    assert choices.forward_resident_bytes(full) > usable_bytes(80 * GIB)
    assert choices.forward_token_budget(full, 4096, batch_tokens=10**6) == 4096


def test_checkpointing_stays_off_when_the_update_fits_and_turns_on_when_it_does_not():
    options = PlanOptions(micro_batch_tokens=16384, gpu_bytes=80 * GIB)
    fitting = choices.choose_checkpointing("qwen2.5-0.5b", QWEN05, options)
    # 0.5b at 16k tokens: ~27 GiB of update, far under 90% of 75 GiB
    assert not fitting.on and fitting.update_without < fitting.limit
    assert fitting.limit == int(0.9 * usable_bytes(80 * GIB))
    # 18.5 GiB of activations shrink to 24 layer inputs and one recomputed layer
    saved = 16384 * (mp.activation_bytes_per_token(QWEN05, False)
                     - mp.activation_bytes_per_token(QWEN05, True))  # fmt: skip
    assert fitting.update_without - fitting.update_with == saved
    small_gpu = dataclasses.replace(options, gpu_bytes=24 * GIB)
    assert choices.choose_checkpointing("qwen2.5-0.5b", QWEN05, small_gpu).on


def test_the_margin_turns_checkpointing_on_for_an_update_that_would_just_fit():
    update = choices.choose_checkpointing(
        "qwen2.5-0.5b", QWEN05, PlanOptions(micro_batch_tokens=16384, gpu_bytes=80 * GIB)
    ).update_without
    # a GPU whose usable memory is 5% above the update: it fits, but not with 10% to spare
    gpu_bytes = int((update * 1.05 + GIB) / 0.95)
    options = PlanOptions(micro_batch_tokens=16384, gpu_bytes=gpu_bytes)
    assert update <= usable_bytes(gpu_bytes)
    assert choices.choose_checkpointing("qwen2.5-0.5b", QWEN05, options).on


def _cfg(*overrides):
    return load_config(None, ["model.path=qwen2.5-0.5b", "actor.max_tokens_per_gpu=8192",
                              *overrides])  # fmt: skip


def test_run_start_resolves_auto_and_the_budgets_with_a_line_each():
    lines = []
    cfg = mc.memory_defaults(_cfg("algorithm.use_kl_in_reward=true"), lines.append, 80 * GIB)
    assert cfg.model.gradient_checkpointing is False
    assert "model.gradient_checkpointing=auto: off (actor update planned at" in lines[0]
    budget = cfg.actor.log_prob_max_tokens_per_gpu
    assert budget == cfg.ref.max_tokens_per_gpu > 8192
    assert f"actor.log_prob_max_tokens_per_gpu and ref.max_tokens_per_gpu = {budget:,}" in lines[1]
    validate(cfg)  # the resolved config is a valid one
    # a value the user set is kept, and needs no line
    lines.clear()
    kept = mc.memory_defaults(_cfg("model.gradient_checkpointing=false",
                                   "actor.log_prob_max_tokens_per_gpu=9000"),
                              lines.append, 80 * GIB)  # fmt: skip
    assert kept.actor.log_prob_max_tokens_per_gpu == 9000 and lines == []


def test_auto_is_on_for_a_run_that_needs_it_and_the_fit_check_plans_with_it():
    cfg = load_config(None, ["model.path=qwen2.5-7b", "actor.optimizer_offload=true",
                             "actor.max_tokens_per_gpu=65536"])  # fmt: skip
    lines = []
    assert mc.memory_defaults(cfg, lines.append, 80 * GIB).model.gradient_checkpointing is True
    assert "auto: on" in lines[0]
    assert mfc.plan_for_config(cfg, validate(cfg), 80 * GIB).options.gradient_checkpointing


def test_without_a_gpu_auto_is_off_and_the_budgets_follow_the_update():
    lines = []
    cfg = mc.memory_defaults(_cfg("trainer.device=cpu"), lines.append)
    assert cfg.model.gradient_checkpointing is False
    assert cfg.actor.log_prob_max_tokens_per_gpu is None  # the learner uses the update's
    assert lines == []  # a CPU run has nothing to decide


def test_an_unknown_checkpointing_value_is_a_config_error():
    with pytest.raises(ConfigError, match="model.gradient_checkpointing = 'sometimes'"):
        validate(_cfg("model.gradient_checkpointing=sometimes"))


# ---- actor.max_tokens_per_gpu=auto


def _linear_update(base_gib: float, per_token_mib: dict[bool, float]):
    """An update that holds base_gib and per_token_mib[checkpointing] for each token."""
    return lambda tokens, on: int(base_gib * GIB + tokens * per_token_mib[on] * 2**20)


GPU = 80 * GIB  # the limit: 80% of what is usable on it
LIMIT = int(0.8 * usable_bytes(GPU))


def test_the_auto_budget_is_the_largest_step_whose_update_fits():
    update = _linear_update(10, {False: 2.0, True: 0.5})
    choice = choices.choose_update_budget(update, GPU, False, max_len=1000, batch_tokens=10**6)
    largest = (LIMIT - 10 * GIB) // (2 * 2**20) // 1024 * 1024
    assert choice == choices.UpdateBudgetChoice(largest, False, True, LIMIT)
    assert update(choice.tokens, False) <= LIMIT < update(choice.tokens + 1024, False)
    # capped at 65,536 tokens and at the GPU's mini-batch, never below one sequence
    roomy = _linear_update(1, {False: 0.01, True: 0.01})
    assert choices.choose_update_budget(roomy, GPU, False, 1000, 10**6).tokens == 65536
    assert choices.choose_update_budget(roomy, GPU, False, 1000, 20_000).tokens == 20480
    assert choices.choose_update_budget(roomy, GPU, False, 30_000, 20_000).tokens == 30720


def test_auto_checkpointing_shrinks_the_budget_to_stay_off_then_turns_on():
    # without recomputing, ~25k tokens fit: off, at a smaller budget than with it
    mid = _linear_update(10, {False: 2.5, True: 0.5})
    choice = choices.choose_update_budget(mid, GPU, "auto", 1000, 10**6)
    assert choice.checkpointing is False and 16384 <= choice.tokens < 65536
    # ~6k tokens would fit without: below 16,384, so checkpointing goes on, with more tokens
    tight = _linear_update(10, {False: 10.0, True: 0.9})
    choice = choices.choose_update_budget(tight, GPU, "auto", 1000, 10**6)
    assert choice.checkpointing is True and choice.tokens > 16384
    assert choices.choose_update_budget(tight, GPU, True, 1000, 10**6) == choice
    # a whole mini-batch under 16,384 tokens that fits without: off
    small = choices.choose_update_budget(tight, GPU, "auto", 1000, 4000)
    assert (small.tokens, small.checkpointing) == (4096, False)
    # not even one sequence: the smallest budget, marked as not fitting
    huge = _linear_update(100, {False: 10.0, True: 10.0})
    assert choices.choose_update_budget(huge, GPU, "auto", 1000, 10**6).fits is False


def _auto_budget_cfg(preset: str, *overrides: str):
    return load_config(None, [f"model.path={preset}", "actor.max_tokens_per_gpu=auto",
                              "data.train_batch_size=128", "actor.ppo_mini_batch_size=128",
                              "rollout.n=8", "data.max_prompt_length=128",
                              "data.max_response_length=256", *overrides])  # fmt: skip


@pytest.mark.parametrize("preset, tokens", [("qwen2.5-0.5b", 65536), ("qwen2.5-1.5b", 37888)])
def test_on_an_h200_auto_keeps_checkpointing_off_at_the_budget_that_allows_it(preset, tokens):
    lines = []
    cfg = mc.memory_defaults(_auto_budget_cfg(preset, "model.gradient_checkpointing=auto"),
                             lines.append, 139 * GIB)  # fmt: skip
    assert cfg.actor.max_tokens_per_gpu == tokens and cfg.model.gradient_checkpointing is False
    assert lines[0].startswith(f"actor.max_tokens_per_gpu=auto: {tokens:,} tokens (the most")
    assert lines[0].endswith("model.gradient_checkpointing=auto: off")
    # the log-prob budget is chosen for the update's new budget; the plan is the explicit one's
    assert cfg.actor.log_prob_max_tokens_per_gpu >= tokens
    auto = mfc.plan_for_config(_auto_budget_cfg(preset, "model.gradient_checkpointing=auto"),
                              gpu_bytes=139 * GIB)  # fmt: skip
    assert auto.options.micro_batch_tokens == tokens
    assert auto.peak() == mfc.plan_for_config(cfg, gpu_bytes=139 * GIB).peak()
    validate(cfg)


def test_auto_budget_without_a_gpu_and_in_a_learner_built_directly():
    lines = []
    cfg = mc.memory_defaults(_auto_budget_cfg("qwen2.5-0.5b", "trainer.device=cpu"), lines.append)
    assert cfg.actor.max_tokens_per_gpu == 16384 and lines == []
    long = _auto_budget_cfg("qwen2.5-0.5b", "trainer.device=cpu", "data.max_response_length=20000")
    assert mc.memory_defaults(long, lines.append).actor.max_tokens_per_gpu == 20480  # a sequence


def test_an_unknown_budget_word_is_a_config_error():
    with pytest.raises(ConfigError, match="actor.max_tokens_per_gpu = 'max' is unknown"):
        validate(_cfg("actor.max_tokens_per_gpu=max"))
