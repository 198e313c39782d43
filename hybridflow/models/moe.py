"""Sparse mixture-of-experts MLP: a softmax top-k router and SwiGLU experts in packed tensors.

Parameter names and layout are transformers 5's in-memory ones (Qwen3-MoE, Mixtral), so a
state dict moves between the two without renaming:

    mlp.gate.weight                [E, H]      router
    mlp.experts.gate_up_proj       [E, 2I, H]  gate rows 0..I-1, then up rows I..2I-1
    mlp.experts.down_proj          [E, H, I]

The math is pure functions (``select_experts``, ``replayed_weights``, ``moe_experts``) that the
module only wires together, so the engine and the tests call the same code. Routing replay
(rollout -> trainer): the expert ids come from the rollout, the gate weights are recomputed from
the current router's probabilities at those ids, so the router still gets gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_BACKENDS = ("auto", "grouped_mm", "loop")

# Marks a token with no recorded route in routed_experts: the router picks its experts.
NO_ROUTE = -1


def select_experts(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32).

    Softmax over all experts in fp32, then the k largest probabilities, renormalised to sum
    to 1 iff norm_topk_prob (Qwen3-MoE reads it from config.json; Mixtral always does)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights


def router(
    hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], gate_weight [E, H] -> (topk_ids [T, k], topk_weights [T, k] fp32,
    router_logits [T, E] in hidden's dtype)."""
    router_logits = F.linear(hidden, gate_weight)
    topk_ids, topk_weights = select_experts(router_logits, top_k, norm_topk_prob)
    return topk_ids, topk_weights, router_logits


def replayed_weights(
    router_logits: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """Gate weights [T, k] fp32 of given expert ids under the current router: the softmax
    probabilities at ``topk_ids``, renormalised iff norm_topk_prob. Differentiable in the
    logits, so the router learns under a replayed routing."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights = probs.gather(-1, topk_ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def replay_routes(
    router_logits: torch.Tensor, recorded_ids: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids, topk_weights) with the recorded ids [T, k] where a token has them and the
    router's own choice where its row holds NO_ROUTE (padding, a token never fed back)."""
    free_ids, _ = select_experts(router_logits, top_k, norm_topk_prob)
    recorded = (recorded_ids >= 0).all(dim=-1, keepdim=True)  # [T, 1]
    topk_ids = torch.where(recorded, recorded_ids.to(free_ids.dtype), free_ids)
    return topk_ids, replayed_weights(router_logits, topk_ids, norm_topk_prob)


def resolve_expert_backend(
    backend: str,
    device: torch.device,
    widths: tuple[int, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The backend for "auto": one grouped GEMM per projection on the GPU (Hopper: 0.69 ms
    against 24.5 ms for a per-expert loop at the Qwen3-30B-A3B shape), the loop on the CPU
    (the reference). torch._grouped_mm needs each operand row (``widths`` elements) to be a
    multiple of 16 bytes, and on CUDA bf16 operands."""
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"expert backend {backend!r} is not one of {EXPERT_BACKENDS}")
    aligned = all(width * dtype.itemsize % 16 == 0 for width in widths)
    if backend == "grouped_mm" and not aligned:
        raise ValueError(f"grouped_mm needs rows of 16 bytes' multiples; widths {widths}")
    if backend != "auto":
        return backend
    # the CUDA kernel takes bf16 only (fp32 weights without autocast: the loop)
    return "grouped_mm" if device.type == "cuda" and dtype == torch.bfloat16 and aligned else "loop"


def masked_grouped_linear(rows: torch.Tensor, weight: torch.Tensor,
                          offsets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """grouped_linear without reading the counts on the host, so a CUDA graph can capture it
    where torch._grouped_mm does not run (fp32: an engine's eager MoE layers under graphs):
    every expert over every row, each row keeping its own expert's product; rows past the
    last run are zero. E times the FLOPs of the split loop: a path for fp32 tests and tiny
    models, bf16 runs take torch._grouped_mm."""
    positions = torch.arange(rows.shape[0], device=rows.device, dtype=offsets.dtype)
    row_expert = torch.searchsorted(offsets, positions, right=True)  # [M]; E: past the runs
    out = rows.new_zeros(rows.shape[0], weight.shape[1])
    for expert in range(weight.shape[0]):
        out = torch.where((row_expert == expert).unsqueeze(-1), F.linear(rows, weight[expert]), out)
    return out


def grouped_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """rows [M, in] sorted by expert (``counts [E]`` rows each; ``offsets`` int32 [E] their
    cumulative ends) times each expert's ``weight [E, out, in]`` transposed -> [M, out]."""
    if backend == "grouped_mm":
        # torch._grouped_mm(a [M, K], b [E, K, N], offs=int32 ends): one launch for all experts;
        # b as a transposed view (column-major per expert) is the layout Hopper's kernel wants.
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        return masked_grouped_linear(rows, weight, offsets)
    sizes = counts.tolist()
    rest = rows.shape[0] - sum(sizes)  # rows past the last expert's run (routed elsewhere)
    pieces = rows.split([*sizes, rest])
    outputs = [F.linear(piece, weight[e]) for e, piece in enumerate(pieces[: len(sizes)])]
    if rest:
        outputs.append(rows.new_zeros(rest, weight.shape[1]))
    return torch.cat(outputs) if outputs else rows.new_zeros(0, weight.shape[1])


def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    backend: str = "auto",
    adapters: ExpertLoRA | None = None,
    first_expert: int | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * down(SiLU(gate(x)) * up(x)).

    hidden [T, H], topk_ids [T, k], topk_weights [T, k], gate_up [E, 2I, H], down [E, H, I]
    -> [T, H] in hidden's dtype. Tokens are sorted by expert, each projection runs as one
    grouped GEMM (or the reference loop), and the k results of a token are summed in fp32
    in a fixed order (no atomics: runs repeat bit for bit). adapters: per-expert LoRA,
    added as two more grouped GEMMs per projection (the weights are never merged).
    first_expert: gate_up and down hold the model's experts [first_expert, first_expert + E)
    only (a rank's share in the tensor-parallel rollout, engine/tensor_parallel.py); a pair
    routed to another expert adds zero. None: they hold every expert (ids are theirs).
    activation: gate_up rows [M, 2I] -> [M, I] (default: SiLU(first half) * second half);
    biases: (gate_up bias [E, 2I], down bias [E, H]) added to each expert's projections."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inner = gate_up.shape[0], gate_up.shape[1] // 2
    widths = (hidden.shape[-1], inner)
    backend = resolve_expert_backend(backend, hidden.device, widths, hidden.dtype)
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    mine = None
    if first_expert is not None:
        local = flat_ids - first_expert
        mine = (local >= 0) & (local < num_experts)  # [T*k]
        flat_ids = torch.where(mine, local, num_experts)  # the others sort past the last run
    order = flat_ids.argsort(stable=True)  # assignments grouped by expert
    # Group ends by binary search in the sorted ids: no host sync (bincount on CUDA has one).
    experts = torch.arange(num_experts, device=flat_ids.device, dtype=flat_ids.dtype)
    offsets = torch.searchsorted(flat_ids[order], experts, right=True).to(torch.int32)  # [E]
    counts = offsets.diff(prepend=offsets.new_zeros(1))
    rows = hidden[order // top_k]  # [T*k, H]

    def project(x: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
        out = grouped_linear(x, weight, counts, offsets, backend)
        if adapters is None:
            return out
        down_a, up_b = (p.to(x.dtype) for p in adapters.factors(name))  # [E, r, in], [E, out, r]
        adapter_backend = backend if x.element_size() * down_a.shape[1] % 16 == 0 else "loop"
        low = grouped_linear(x, down_a, counts, offsets, adapter_backend)  # [T*k, r]
        return out + adapters.scale * grouped_linear(low, up_b, counts, offsets, adapter_backend)

    row_experts = flat_ids[order].clamp(max=num_experts - 1)  # each sorted row's expert
    gate_up_rows = project(rows, gate_up, "gate_up")  # [T*k, 2I]
    if biases is not None:
        gate_up_rows = gate_up_rows + biases[0].to(gate_up_rows.dtype)[row_experts]
    activated = swiglu(gate_up_rows) if activation is None else activation(gate_up_rows)
    expert_out = project(activated, down, "down")  # [T*k, H]
    if biases is not None:
        expert_out = expert_out + biases[1].to(expert_out.dtype)[row_experts]
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)
    if mine is not None:  # rows past the last run: zeros (loop) or unwritten (grouped_mm)
        unsorted = torch.where(mine[:, None], unsorted, 0)
    weighted = (
        unsorted.view(num_tokens, top_k, unsorted.shape[-1]).float()
        * topk_weights[..., None].float()
    )
    return weighted.sum(dim=1).to(hidden.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate columns, then up columns) -> SiLU(gate) * up [M, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertSlice:
    """One rank's share of a sparse layer in the tensor-parallel rollout (vLLM's expert
    parallelism inside a tensor-parallel group): its expert tensors hold the model's experts
    [first, first + E / ranks), whole; every rank routes every token with the whole router,
    runs its own experts and one all-reduce over ``group`` sums the partial outputs."""

    first: int
    group: object


def sliced_moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_slice: ExpertSlice,
    backend: str = "auto",
) -> torch.Tensor:
    """moe_experts over this rank's experts, summed over the slice's group -> [T, H], the
    same on every rank (collective: every rank of the group calls it with the same tokens)."""
    import torch.distributed as dist

    out = moe_experts(hidden, topk_ids, topk_weights, gate_up, down, backend,
                      first_expert=expert_slice.first)  # fmt: skip
    dist.all_reduce(out, group=expert_slice.group)
    return out


class ExpertLoRA(nn.Module):
    """Per-expert low-rank adapters of the packed expert tensors (peft adapts nn.Linear
    layers only): W_e + scale * B_e @ A_e for each expert e of gate_up_proj and down_proj.

    The factors are named by that merge, whatever the layout the experts store: for
    [E, out, in] (Experts) A [E, r, in] is applied first and B [E, out, r] second; for
    [E, in, out] (GPT-OSS's, ``stored_in_out``) B [E, in, r] first and A [E, r, out] second.
    The factor applied first is drawn like peft's A (kaiming-uniform, a = sqrt(5)), the other
    starts at 0, so an adapted model starts equal to its base. Every factor has the expert
    axis first (expert parallelism splits them with their experts). ``disabled`` runs the
    base (the reference policy)."""

    def __init__(self, experts: nn.Module, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.stored_in_out = getattr(experts, "stored_in_out", False)
        num_experts = experts.gate_up_proj.shape[0]
        device = experts.gate_up_proj.device

        def first_factor(width: int) -> torch.Tensor:  # [E, r, in] ~ U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(width)
            values = torch.rand(num_experts, rank, width, generator=generator, device=device)
            return (2 * values - 1) * bound

        for name in ("gate_up", "down"):
            stored = getattr(experts, f"{name}_proj")
            width_in, width_out = stored.shape[1:] if self.stored_in_out else stored.shape[:0:-1]
            drawn = first_factor(width_in)  # [E, r, in]
            zeros = torch.zeros(num_experts, width_out, rank, device=device)  # [E, out, r]
            a, b = drawn, zeros
            if self.stored_in_out:  # B [E, in, r] @ A [E, r, out] = [E, in, out]
                a, b = zeros.transpose(1, 2).contiguous(), drawn.transpose(1, 2).contiguous()
            setattr(self, f"{name}_A", nn.Parameter(a))
            setattr(self, f"{name}_B", nn.Parameter(b))
        self.scale = alpha / rank
        self.disabled = False

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(first [E, r, in], second [E, out, r]) of "gate_up" or "down", in the order
        moe_experts applies them (this rank's experts under expert parallelism)."""
        a, b = local_part(getattr(self, f"{name}_A")), local_part(getattr(self, f"{name}_B"))
        if self.stored_in_out:
            return b.transpose(1, 2), a.transpose(1, 2)
        return a, b

    def delta(self, name: str) -> torch.Tensor:
        """scale * B @ A in fp32, in the stored layout: what merging adds to the expert tensor."""
        a, b = getattr(self, f"{name}_A"), getattr(self, f"{name}_B")
        return self.scale * torch.bmm(b.float(), a.float())


def active_adapters(adapters: ExpertLoRA | None) -> ExpertLoRA | None:
    """The experts' LoRA when attached and on, else None."""
    return None if adapters is None or adapters.disabled else adapters


class TopKRouter(nn.Module):
    """HF's ``mlp.gate``: one linear map to the expert logits (its ``weight [E, H]``)."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class Experts(nn.Module):
    """HF's ``mlp.experts``: every expert's projections stacked on a leading expert axis.

    ``forward`` runs the routed tokens through them, so that a wrapper of this module (FSDP2
    sharding the experts over the ranks that hold the same ones, learners/sharding/expert_shard.py)
    sees its parameters used inside its own call."""

    stored_in_out = False  # [E, out, in]
    expert_tensors = ("gate_up_proj", "down_proj")  # expert parallelism splits these on dim 0

    def __init__(self, num_experts: int, hidden_size: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner))
        self.lora: ExpertLoRA | None = None  # set by learners/lora.py

    def forward(
        self,
        flat: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        backend: str = "auto",
        group=None,
        dispatch=None,
    ) -> torch.Tensor:
        """flat [T, H] in the compute dtype, topk_ids / topk_weights [T, k] -> [T, H].
        group: the expert-parallel group (these tensors hold its rank's E/EP experts), run by
        ``dispatch`` (models/sharding/expert_parallel.expert_parallel_moe, set with the group)."""
        dtype = flat.dtype
        gate_up, down = local_part(self.gate_up_proj), local_part(self.down_proj)
        if gate_up.dtype != dtype:  # fp32 masters under autocast: a compute copy
            gate_up, down = gate_up.to(dtype), down.to(dtype)
        adapters = active_adapters(self.lora)
        if group is not None:
            return dispatch(flat, topk_ids, topk_weights, gate_up, down, group, backend, adapters)
        return moe_experts(flat, topk_ids, topk_weights, gate_up, down, backend, adapters)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer. ``forward(x)`` returns the output only (what the engine
    calls); ``forward_routed`` also returns the routing, for the trainer's losses, metrics
    and routing replay.

    Attributes:
        expert_backend: one of EXPERT_BACKENDS ("auto": grouped GEMMs on CUDA, loop on CPU).
        expert_group: expert parallelism (models/sharding/expert_parallel.py): the experts hold this
            rank's E/EP experts and tokens are dispatched over the group; None: all experts.
        expert_slice: the tensor-parallel rollout's split (engine/tensor_parallel.py): the
            experts hold this rank's share, every token is routed here and the partial
            outputs are summed over the group; None: all experts.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = TopKRouter(config.num_experts, config.hidden_size)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.expert_backend = "auto"
        self.expert_group = None
        self.expert_dispatch = None  # how the experts run over expert_group (set beside it)
        self.expert_slice: ExpertSlice | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(x)[0]

    def forward_routed(
        self, x: torch.Tensor, recorded_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H]; recorded_ids [T, k] (T = tokens of x; NO_ROUTE rows route freely) or
        None -> (out [..., H], router_logits [T, E], topk_ids [T, k])."""
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        # Autocast casts what F.linear touches, not torch._grouped_mm's operands: the experts
        # take its dtype themselves (a dense MLP's output dtype under autocast, too).
        device_type = x.device.type
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else x.dtype
        )
        flat = flat.to(dtype)
        router_logits, topk_ids, topk_weights = self.route(flat, recorded_ids)
        out = self.run_experts(flat, topk_ids, topk_weights)
        return out.view(*x.shape[:-1], -1), router_logits, topk_ids

    def route(
        self, flat: torch.Tensor, recorded_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """flat [T, H] -> (router_logits [T, E], topk_ids [T, k], topk_weights [T, k] fp32),
        the recorded routes replayed where given."""
        router_logits = F.linear(flat, self.gate.weight.to(flat.dtype))  # [T, E]
        if recorded_ids is None:
            topk_ids, topk_weights = select_experts(router_logits, self.top_k, self.norm_topk_prob)
        else:
            topk_ids, topk_weights = replay_routes(
                router_logits, recorded_ids, self.top_k, self.norm_topk_prob
            )
        return router_logits, topk_ids, topk_weights

    def run_experts(
        self, flat: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] (sliced or expert-parallel as set)."""
        if self.expert_slice is not None:
            experts = self.experts
            return sliced_moe_experts(flat, topk_ids, topk_weights, experts.gate_up_proj,
                                      experts.down_proj, self.expert_slice, self.expert_backend)  # fmt: skip
        return self.experts(flat, topk_ids, topk_weights, self.expert_backend, self.expert_group,
                            self.expert_dispatch)  # fmt: skip


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert tensor (a DTensor over the expert-parallel group holds
    the rank's experts locally); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
