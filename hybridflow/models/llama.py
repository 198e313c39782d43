"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm),
and their mixture-of-experts relatives Qwen3-MoE and Mixtral (sparse MLPs: models/moe.py).

Parameter names equal Hugging Face's (transformers 5's in memory), so state dicts move without
renaming. A layer works on any leading shape ([B, T, H] padded or [N, H] packed); only the
attention function passed in differs, so the padded and packed forwards share every other line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.attention import (
    Attend,
    make_packed_attention,
    padded_causal_attention,
    resolve_backend,
)
from hybridflow.models.moe import SparseMoeBlock
from hybridflow.models.rope import apply_rope, rope_cos_sin
from hybridflow.models.sequence_parallel import ulysses_attention

# One sparse layer's routing from a forward: (router_logits [N, E], topk_ids [N, k]).
RouterTrace = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm accumulates in fp32 and is one fused kernel on CUDA, but only when input
        # and weight share a dtype: under bf16 autocast with fp32 master weights (the unsharded
        # training path) it fell back to an unfused composite (torch warned on the H200). The
        # cast matches FSDP2's mixed precision, which hands the layer bf16 weights.
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelArchitecture):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., H] -> q [..., nh, hd], k/v [..., nkv, hd], with qk-norm and RoPE applied.

        Exposed separately so the generation engine can write k/v into its cache."""
        # -1 heads: under tensor parallelism the projections hold this rank's heads only
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        return self.o_proj(attend(q, k, v).flatten(-2))


class MLP(nn.Module):
    def __init__(self, config: ModelArchitecture):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchitecture, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = config.is_sparse_layer(index)
        self.mlp = SparseMoeBlock(config) if self.sparse else MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        recorded_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> (hidden, router_logits [N, E], topk_ids [N, k]); the routing is None on a dense
        layer. recorded_ids [N, k]: routes to replay (sparse layers; moe.NO_ROUTE = free)."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attend)
        normed = self.post_attention_layernorm(hidden)
        if not self.sparse:
            return hidden + self.mlp(normed), None, None
        out, router_logits, topk_ids = self.mlp.forward_routed(normed, recorded_ids)
        return hidden + out, router_logits, topk_ids


class DecoderStack(nn.Module):
    """HF's `model` submodule: embeddings, layers, final norm."""

    def __init__(self, config: ModelArchitecture):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama-family causal LM with HF parameter names.

    ``num_labels``: the sequence-classification variant (HF's ``*ForSequenceClassification``,
    a reward model): a ``score`` head [num_labels, H] instead of ``lm_head``, read at the last
    token of each sequence (:meth:`forward_scores`).

    Attributes:
        gradient_checkpointing: recompute each layer in backward (saves activations) when True.
        attention_backend: packed attention kernel, one of attention.PACKED_BACKENDS; "auto"
            picks the measured fastest for the device and dtype.
        deterministic_attention: the packed flash backward in a fixed reduction order
            (attention.deterministic_kernels), so runs with one seed repeat bit for bit.
    """

    def __init__(self, config: ModelArchitecture, num_labels: int | None = None):
        super().__init__()
        self.config = config
        self.num_labels = num_labels
        self.model = DecoderStack(config)
        if num_labels is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = None
            self.score = nn.Linear(config.hidden_size, num_labels, bias=False)
        self.gradient_checkpointing = False
        self.attention_backend = "auto"
        self.deterministic_attention = True
        self.tie_weights()

    # -- weights ------------------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Make lm_head share the embedding Parameter when the config says so."""
        if self.config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """HF-style init (normal(0, std) matrices, zero biases, unit norms), reproducible."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, SparseMoeBlock):  # router and experts: HF's normal(0, std)
                for param in module.parameters():
                    param.normal_(0.0, std, generator=generator)

    def enable_gradient_checkpointing(self, enabled: bool = True) -> None:
        self.gradient_checkpointing = enabled

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- forward ------------------------------------------------------------------------------

    def _check_window(self, seq_len: int) -> None:
        """Attention here is full-causal; equal to Mistral's sliding window only within it."""
        window = self.config.sliding_window
        if window is not None and seq_len > window:
            raise ValueError(
                f"sequence of {seq_len} tokens exceeds sliding_window={window}, which this "
                "decoder does not implement; load the model with backend='hf'"
            )

    def _run_layers(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        routed_experts: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
    ) -> torch.Tensor:
        """routed_experts [N, L_sparse, k]: routes to replay, one slice per sparse layer in
        order; router_trace: gets each sparse layer's (router_logits, topk_ids) appended."""
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        sparse_index = 0
        for layer in self.model.layers:
            recorded = None
            if routed_experts is not None and layer.sparse:
                recorded = routed_experts[:, sparse_index]
            if recompute:
                hidden, logits, ids = checkpoint(
                    layer, hidden, cos, sin, attend, recorded, use_reentrant=False
                )
            else:
                hidden, logits, ids = layer(hidden, cos, sin, attend, recorded)
            if layer.sparse:
                sparse_index += 1
                if router_trace is not None:
                    router_trace.append((logits, ids))
        return self.model.norm(hidden)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T], attention_mask [B, T] (left or right padding) -> hidden [B, T, H].
        router_trace: as in forward_packed, with the B*T tokens flattened row by row."""
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = positions.expand(input_ids.shape)
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        self._check_window(input_ids.shape[1])
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, positions, hidden.dtype)

        def attend(q, k, v):
            return padded_causal_attention(q, k, v, attention_mask)

        return self._run_layers(hidden, cos, sin, attend, router_trace=router_trace)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in the model dtype ([B, T, num_labels] for
        the sequence-classification variant)."""
        head = self.lm_head if self.lm_head is not None else self.score
        return head(self.forward_hidden(input_ids, attention_mask, router_trace))

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        routed_experts: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Many sequences concatenated: input_ids/position_ids [N], cu_seqlens int32 [S+1].

        Returns the final-norm hidden states [N, H] (no lm_head: log-probs are computed from
        them in chunks, see logprobs.py). Attention never crosses a sequence boundary.
        Mixture-of-experts models: routed_experts int [N, L_sparse, k] replays recorded routes
        (moe.NO_ROUTE rows route freely); router_trace, a list, receives each sparse layer's
        (router_logits [N, E], topk_ids [N, k]) for the router losses and metrics.

        sequence_group: Ulysses sequence parallelism (models/sequence_parallel.py). Then
        input_ids, position_ids and routed_experts are this rank's contiguous slice of a
        stream of SP × N tokens, cu_seqlens and max_seqlen describe that whole stream, and the
        result is the slice's hidden states [N, H]."""
        self._check_window(int(max_seqlen))
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.config, position_ids, hidden.dtype)
        backend = resolve_backend(self.attention_backend, hidden.device, hidden.dtype)
        sp_size = 1 if sequence_group is None else dist.get_world_size(sequence_group)
        attend = make_packed_attention(
            backend,
            cu_seqlens.to(torch.int32),
            int(max_seqlen),
            input_ids.shape[0] * sp_size,
            deterministic=self.deterministic_attention,
        )
        if sequence_group is not None:
            attend = ulysses_attention(attend, sequence_group)
        return self._run_layers(hidden, cos, sin, attend, routed_experts, router_trace)

    def forward_scores(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Sequence-classification variant: packed sequences (as forward_packed) -> the
        score head at each sequence's last token that is not ``pad_token_id``, as
        transformers' ``*ForSequenceClassification`` pools: [S, num_labels] fp32."""
        from hybridflow.models.sequence_scores import last_token_index

        hidden = self.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)  # [N, H]
        last = last_token_index(input_ids, cu_seqlens, pad_token_id)  # [S]
        return self.score(hidden[last]).float()

    # -- io -----------------------------------------------------------------------------------

    def save_pretrained(
        self, save_directory: str, max_shard_size: int = 5 * 1024**3, tokenizer=None
    ) -> None:
        """Write config.json + safetensors (sharded with an index above max_shard_size bytes),
        plus the tokenizer files when a tokenizer is given: a directory transformers loads."""
        from hybridflow.models.hf_checkpoint import save_model

        save_model(self, save_directory, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)
