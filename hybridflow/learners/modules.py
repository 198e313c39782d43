"""The trained modules: a causal LM that returns per-token log-probs, and a value model.

Each does all of its work inside one ``forward`` call. That matters under FSDP2: the root
unit's parameters (embeddings, final norm, lm_head, value head) are gathered in the forward
pre-hook and released after, so the lm_head weight must be used inside ``forward``, not in a
separate call afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.learners.packing import PackedRows, pad_tokens
from hybridflow.learners.sharding.sequence_shard import OutputShard, sharded_hidden
from hybridflow.models.heads.logprobs import logprobs_from_hidden
from hybridflow.models.sharding.tensor_parallel import vocab_shard
from hybridflow.models.sharding.vocab_parallel import vocab_parallel_logprobs

# (router_logits [N, E], topk_ids [N, k]) of each sparse layer of one forward (models/llama.py)
RouterTrace = list[tuple[torch.Tensor, torch.Tensor]]


def decoder_layers(causal_lm: nn.Module) -> list[nn.Module]:
    """The decoder layers of a CausalLM (each one becomes an FSDP unit)."""
    return list(causal_lm.model.layers)


class PolicyModel(nn.Module):
    """``forward(packed) -> (logprobs [M], entropy [M] | None)`` of the packed targets.

    replay_routes: a mixture of experts routes each token to the experts in
    ``packed.routed_experts`` when it has them (actor.router_replay=rollout).
    sequence_group: Ulysses sequence parallelism over this group (learners/sharding/sequence_shard.py);
    every rank of it gets the same packed rows and returns the same outputs.
    fused_head: the fused log-prob head (model.fused_logprob_head, models/heads/fused_head.py).
    token_multiple: the tokens each forward runs padded to a multiple of it (FP8 training's 16:
    packing.pad_tokens; under sequence parallelism each rank's slice)."""

    def __init__(
        self,
        causal_lm: nn.Module,
        replay_routes: bool = False,
        sequence_group: dist.ProcessGroup | None = None,
        fused_head: bool = True,
        token_multiple: int = 1,
    ):
        super().__init__()
        self.lm = causal_lm
        self.replay_routes = replay_routes
        self.sequence_group = sequence_group
        self.fused_head = fused_head
        self.token_multiple = token_multiple

    def forward(
        self,
        packed: PackedRows,
        temperature: float = 1.0,
        with_entropy: bool = False,
        router_trace: RouterTrace | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """router_trace: a list that receives each sparse layer's routing (router losses and
        metrics of a mixture of experts; our decoder only)."""
        routing = {}
        if self.replay_routes and packed.routed_experts is not None:
            routing["routed_experts"] = packed.routed_experts
        if router_trace is not None:
            routing["router_trace"] = router_trace
        hidden, outputs = packed_hidden(
            self.lm, packed, self.sequence_group, routing, self.token_multiple
        )  # [m, H]
        targets = (
            packed.targets if outputs is None else packed.targets[outputs.start : outputs.stop]
        )
        hidden, weight = lm_head_operands(self.lm.lm_head, hidden)
        logprobs, entropy = head_logprobs(
            hidden, weight, targets, temperature, with_entropy, fused=self.fused_head
        )
        if outputs is None:
            return logprobs, entropy
        return outputs.gather(logprobs), (None if entropy is None else outputs.gather(entropy))


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``targets`` from hidden states [m, H] and the lm_head
    weight: whole (fused: models/heads/fused_head.py), or split by vocabulary over a
    tensor-parallel group."""
    shard = vocab_shard(weight)
    if shard is not None:
        rows, group, vocab_start = shard
        return vocab_parallel_logprobs(
            hidden, rows, targets, group, vocab_start=vocab_start, temperature=temperature,
            with_entropy=with_entropy,
        )  # fmt: skip
    if weight.dtype != hidden.dtype:
        # Under autocast (unsharded bf16 path) the chunked log-prob kernel's backward runs
        # outside autocast, so hand it one dtype; the cast is differentiable.
        weight = weight.to(hidden.dtype)
    return logprobs_from_hidden(
        hidden, weight, targets, temperature=temperature, with_entropy=with_entropy, fused=fused
    )


def lm_head_operands(lm_head: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [m, H'], weight [V, H']) whose product is the lm_head's logits.

    A plain head: (hidden, weight). A head with an active LoRA adapter (peft's, "lm_head" in
    model.lora_target_modules): logits = h W^T + s (dropout(h) A^T) B^T = [h, s dropout(h)
    A^T] @ [W, B]^T, so the head stays one matmul (the log-prob head never forms logits) and
    the gradients reach A and B through the concatenation."""
    adapters = getattr(lm_head, "lora_A", None)
    active = [
        name for name in getattr(lm_head, "active_adapters", []) if adapters and name in adapters
    ]
    if not active or lm_head.disable_adapters or lm_head.merged:
        return hidden, lm_head.weight
    hiddens, weights = [hidden], [lm_head.weight]
    for name in active:
        a, b = lm_head.lora_A[name].weight, lm_head.lora_B[name].weight  # [r, H], [V, r]
        x = lm_head.lora_dropout[name](hidden.to(a.dtype))
        hiddens.append((x @ a.T * lm_head.scaling[name]).to(hidden.dtype))  # [m, r]
        weights.append(b.to(lm_head.weight.dtype))
    return torch.cat(hiddens, -1), torch.cat(weights, -1)


def packed_hidden(
    lm: nn.Module,
    packed: PackedRows,
    sequence_group: dist.ProcessGroup | None,
    routing: dict,
    token_multiple: int = 1,
) -> tuple[torch.Tensor, OutputShard | None]:
    """Final hidden states [m, H] at the tokens that predict the packed targets: all M of them,
    or under sequence parallelism this rank's share (and which share it is). token_multiple:
    the tokens the model runs padded to a multiple of it (packing.pad_tokens; under sequence
    parallelism each rank's slice, sequence_shard.sharded_hidden)."""
    images = {}
    if packed.pixel_values is not None:
        images = {"pixel_values": packed.pixel_values, "image_grid_thw": packed.image_grid_thw,
                  "image_slots": packed.prompt_tokens}  # fmt: skip
    if sequence_group is not None:  # the images embedded before the split (sequence_shard)
        return sharded_hidden(lm, packed, sequence_group, **routing,
                              token_multiple=token_multiple, **images)  # fmt: skip
    packed = pad_tokens(packed, token_multiple)
    if "routed_experts" in routing:  # the replayed routes padded with the tokens
        routing = {**routing, "routed_experts": packed.routed_experts}
    hidden = lm.forward_packed(
        packed.input_ids,
        packed.position_ids,
        packed.cu_seqlens,
        packed.max_seqlen,
        **routing,
        **images,
    )  # [N, H]
    return hidden[packed.hidden_index], None


class ValueModel(nn.Module):
    """A causal-LM backbone with a scalar head: ``forward(packed) -> values [M]`` (fp32).

    The value of response token ``t`` is read where its log-prob would be (the state before
    the token is chosen). The lm_head is unused; when it is not tied to the embeddings it is
    frozen so the optimizer keeps no state for it.
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        value_head: nn.Linear | None = None,
        sequence_group: dist.ProcessGroup | None = None,
        token_multiple: int = 1,
    ):
        super().__init__()
        self.lm = causal_lm
        self.sequence_group = sequence_group
        self.token_multiple = token_multiple  # as PolicyModel's
        hidden_size = causal_lm.config.hidden_size
        if value_head is None:
            weight = causal_lm.lm_head.weight
            value_head = nn.Linear(hidden_size, 1, device=weight.device, dtype=weight.dtype)
            # Zero init: values start at 0 (an unbiased baseline); the backbone gets gradients
            # once the head has moved away from 0 after the first step.
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head
        if causal_lm.lm_head.weight is not causal_lm.model.embed_tokens.weight:
            causal_lm.lm_head.weight.requires_grad_(False)

    def forward(self, packed: PackedRows) -> torch.Tensor:
        hidden, outputs = packed_hidden(
            self.lm, packed, self.sequence_group, {}, self.token_multiple
        )  # [m, H]
        values = self.value_head(hidden).squeeze(-1).float()
        return values if outputs is None else outputs.gather(values)  # [M]
