"""Synthetic RL batches and small learners for the learner tests (tiny preset, fp32, CPU)."""

from __future__ import annotations

import torch

from hybridflow.config import ActorConfig
from hybridflow.models import load_model
from hybridflow.protocol import Batch


def make_batch(
    num_rows: int = 8, prompt_len: int = 6, response_len: int = 5, vocab: int = 128, seed: int = 0
) -> Batch:
    """Left-padded prompts, right-padded responses of random lengths, random advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, vocab, (num_rows, prompt_len), generator=g)
    responses = torch.randint(5, vocab, (num_rows, response_len), generator=g)
    prompt_lens = torch.randint(1, prompt_len + 1, (num_rows,), generator=g)
    response_lens = torch.randint(1, response_len + 1, (num_rows,), generator=g)
    cols_p = torch.arange(prompt_len)
    cols_r = torch.arange(response_len)
    prompt_mask = cols_p[None, :] >= (prompt_len - prompt_lens)[:, None]
    response_mask = cols_r[None, :] < response_lens[:, None]
    prompts = prompts.masked_fill(~prompt_mask, 0)
    responses = responses.masked_fill(~response_mask, 0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    advantages = torch.randn(num_rows, response_len, generator=g) * response_mask
    # Old log-probs near plausible values so ratios differ from 1 and clipping happens.
    old_logprobs = (-torch.rand(num_rows, response_len, generator=g) * 6 - 3) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention_mask,
            "response_mask": response_mask.float(),
            "advantages": advantages,
            "old_logprobs": old_logprobs,
            "ref_logprobs": old_logprobs + 0.1 * response_mask,
        }
    )


def tiny_model(seed: int = 0):
    model = load_model("tiny")
    if seed:
        model.init_weights(seed=seed)
    return model


def actor_config(**overrides) -> ActorConfig:
    base = dict(
        lr=1e-2,
        ppo_mini_batch_size=4,
        micro_batch_size_per_gpu=4,
        grad_clip=1.0,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    base.update(overrides)
    return ActorConfig(**base)


def flat_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def record_full_gradients(actor) -> list[dict[str, torch.Tensor]]:
    """Wrap ``actor``'s optimizer step so that each call first records every parameter's
    full gradient (gathered from its shards under FSDP2): one dict per optimizer step."""
    recorded = []
    step = actor.core.optimizer_step

    def recording_step(grad_clip):
        grads = {}
        for name, param in actor.model.named_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
        recorded.append(grads)
        return step(grad_clip)

    actor.core.optimizer_step = recording_step
    return recorded


def record_float8_token_counts(module: torch.nn.Module) -> list[int]:
    """The token count of every input to ``module``'s torchao Float8Linears, one entry per
    forward call (the backward's two matmuls have the same tokens: the grad-input's rows, the
    grad-weight's inner dim). Empty when nothing converted."""
    from torchao.float8.float8_linear import Float8Linear

    counts: list[int] = []
    for layer in module.modules():
        if isinstance(layer, Float8Linear):
            layer.register_forward_pre_hook(
                lambda _layer, args: counts.append(args[0].shape[:-1].numel())
            )
    return counts
