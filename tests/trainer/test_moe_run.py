"""examples/moe.yaml end to end, shortened: the rollout engine records each token's experts,
the trainer replays them, and the router losses and metrics are logged."""

import math

from trainer_helpers import read_metrics, tiny_config

from hybridflow.trainer.lifecycle.run import train


def test_moe_example_replays_the_rollouts_routes_and_learns(tmp_path, quiet):
    # the example shrunk as the dense learning test is (tests/trainer/test_learning.py): a
    # random tiny-moe, reward = the fraction of digits in the response, two mini-batches
    cfg = tiny_config(
        tmp_path,
        "model.path=tiny-moe",
        "trainer.total_steps=14",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "actor.lr=3e-3",
        "trainer.val_before_train=false",
        example="moe",
    )
    assert cfg.actor.router_replay == "rollout"
    train(cfg, log=quiet)
    rows = read_metrics(cfg.trainer.run_dir)
    scores = [row["score/mean"] for _, row in sorted(rows.items())]
    first, last_scores = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert last_scores > 2 * first and last_scores > first + 0.1, scores
    last = rows[max(rows)]
    replayed = next(v for k, v in last.items() if k.endswith("moe/replayed_token_fraction"))
    # every token the engine fed through the model has its route; the last sampled token of
    # each response (never fed back) and nothing else is routed by the trainer
    assert 0.7 < replayed < 1.0, replayed
    assert any(k.endswith("moe/aux_loss") for k in last)
    # two mini-batches: the old-log-prob pass ran; fp32 on the CPU, the engine's torch path
    # computes what the trainer does, and both route alike
    assert last["rollout_gap/abs_logprob_diff_max"] < 1e-4
    assert any(k.endswith("moe/router_entropy") for k in last)


def test_recorded_routes_are_the_trainers_own_at_the_same_columns():
    """fp32 on the CPU the engine and the trainer route alike, so every recorded entry of
    routed_experts [B, P+R, L, k] equals the trainer's routing of that column."""
    import torch

    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.engine.scheduling.routes import padded_routes
    from hybridflow.learners.packing import pack_rows
    from hybridflow.models import load_model
    from hybridflow.models.moe import NO_ROUTE

    model = load_model("tiny-moe")
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    n, width, prompt_width = 2, 6, 5
    results = Engine(model, max_batch_size=8, max_seq_len=16).generate(
        prompts, SamplingParams(n=n, max_new_tokens=width, seed=3, temperature=1.0)
    )
    lengths = [len(p) for p in prompts for _ in range(n)]
    routes = padded_routes([c.routed_experts for c in results], lengths, prompt_width, width)
    rows = len(results)
    prompt_ids = torch.zeros(rows, prompt_width, dtype=torch.long)
    responses = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, prompt_width + width, dtype=torch.long)
    for row, (completion, length) in enumerate(zip(results, lengths)):
        prompt_ids[row, prompt_width - length :] = torch.tensor(prompts[row // n])
        mask[row, prompt_width - length : prompt_width + len(completion.token_ids)] = 1
        responses[row, : len(completion.token_ids)] = torch.tensor(completion.token_ids)
    packed = pack_rows(prompt_ids, responses, mask)
    trace = []
    with torch.no_grad():
        model.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens,
                             packed.max_seqlen, router_trace=trace)  # fmt: skip
    own = torch.stack([ids for _, ids in trace], dim=1)  # [N, L, k]
    recorded = routes[mask.bool()].long()  # [N, L, k], the same token order
    has_route = recorded[:, 0, 0] != NO_ROUTE
    assert (routes[~mask.bool()] == NO_ROUTE).all()  # padding
    assert int((~has_route).sum()) == rows  # each response's last token only
    assert torch.equal(recorded[has_route], own[has_route])


def test_sft_of_a_mixture_of_experts_logs_its_routing_without_a_balancing_loss():
    """No load-balancing loss in SFT (measured: it slowed the demo's warm start and halved
    GRPO's gain; transformers adds it only with output_router_logits), its metrics logged."""
    from hybridflow.config import load_config
    from hybridflow.data.sft_examples import SFTExample
    from hybridflow.models import load_model
    from hybridflow.trainer.loop.sft_loop import SFTTrainer, examples_to_batch

    model = load_model("tiny-moe")
    trainer = SFTTrainer(model, load_config(None, []).sft, device="cpu", grad_clip=1.0)
    examples = [SFTExample([3, p, 20, 21, 4], [0, 0, 1, 1, 1]) for p in range(10, 26)]
    metrics = trainer.step(examples_to_batch(examples, pad_token_id=0))
    assert "sft/moe/aux_loss" not in metrics
    assert 0 < metrics["sft/moe/router_entropy"] <= math.log(8)
    assert metrics["sft/moe/expert_load_max_over_mean"] >= 1.0
