"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (qk-norm),
and their mixture-of-experts relatives Qwen3-MoE and Mixtral (sparse MLPs: models/moe.py).

Parameter names equal Hugging Face's (transformers 5's in memory), so state dicts move without
renaming. A layer works on any leading shape ([B, T, H] padded or [N, H] packed); only the
attention function passed in differs, so the padded and packed forwards share every other line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.attention import (
    Attend,
    make_packed_attention,
    padded_causal_attention,
    resolve_backend,
)
from hybridflow.models.layer_spec import LayerSpec
from hybridflow.models.mixers.attention import Attention
from hybridflow.models.mixers.gated_attention import GatedAttention
from hybridflow.models.mixers.gated_deltanet import GatedDeltaNet, TokenLayout
from hybridflow.models.mixers.mla import MultiHeadLatentAttention
from hybridflow.models.mixers.sink_attention import SinkAttention
from hybridflow.models.mlps.biased_experts import BiasedExpertsMoeBlock
from hybridflow.models.mlps.dense import MLP
from hybridflow.models.mlps.grouped_experts import GroupedExpertsMoeBlock
from hybridflow.models.mlps.shared_experts import SharedExpertMoeBlock
from hybridflow.models.moe import SparseMoeBlock
from hybridflow.models.mrope import batch_mrope_positions, mrope_cos_sin
from hybridflow.models.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm, make_rms_norm
from hybridflow.models.rope import rope_cos_sin
from hybridflow.models.sharding.sequence_parallel import ulysses_attention
from hybridflow.models.vision.encoders import vision_encoder
from hybridflow.models.vision.qwen2_5_vl import PatchEmbed

__all__ = ["MLP", "Attention", "CausalLM", "DecoderLayer", "RMSNorm", "RouterTrace"]

# One sparse layer's routing from a forward: (router_logits [N, E], topk_ids [N, k]).
RouterTrace = list[tuple[torch.Tensor, torch.Tensor]]


def build_mixer(spec: LayerSpec, config: ModelArchitecture) -> nn.Module:
    """The token mixer module of ``spec.mixer`` (models/mixers/)."""
    if spec.mixer == "attention":
        return Attention(config)
    if spec.mixer == "gated_attention":
        return GatedAttention(config)
    if spec.mixer == "gated_deltanet":
        return GatedDeltaNet(config)
    if spec.mixer == "mla":
        return MultiHeadLatentAttention(config)
    if spec.mixer == "sink_attention":
        return SinkAttention(config, spec.window)
    raise ValueError(f"mixer {spec.mixer!r} has no module in this decoder")


def build_mlp(spec: LayerSpec, config: ModelArchitecture) -> nn.Module:
    """The channel mixer module of ``spec.mlp`` (models/mlps/, models/moe.py)."""
    if spec.mlp == "dense":
        return MLP(config)
    if spec.mlp == "experts":
        return SparseMoeBlock(config)
    if spec.mlp == "experts_shared":
        return SharedExpertMoeBlock(config)
    if spec.mlp == "grouped_experts_shared":
        return GroupedExpertsMoeBlock(config)
    if spec.mlp == "biased_experts":
        return BiasedExpertsMoeBlock(config)
    raise ValueError(f"mlp {spec.mlp!r} has no module in this decoder")


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``; the mixer
    and the MLP are the kinds its LayerSpec names, under HF's module names."""

    def __init__(self, config: ModelArchitecture, index: int = 0, spec: LayerSpec | None = None):
        super().__init__()
        self.spec = config.layer_specs()[index] if spec is None else spec
        hidden, eps, centered = config.hidden_size, config.rms_norm_eps, config.zero_centered_norms
        self.input_layernorm = make_rms_norm(hidden, eps, centered)
        self.mixer_name = self.spec.mixer_module
        self.add_module(self.mixer_name, build_mixer(self.spec, config))
        self.post_attention_layernorm = make_rms_norm(hidden, eps, centered)
        self.sparse = self.spec.sparse
        self.mlp = build_mlp(self.spec, config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        recorded_ids: torch.Tensor | None = None,
        layout: TokenLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> (hidden, router_logits [N, E], topk_ids [N, k]); the routing is None on a dense
        layer. recorded_ids [N, k]: routes to replay (sparse layers; moe.NO_ROUTE = free).
        layout: where the sequences are, for mixers that run along them (recurrent ones)."""
        mixer = getattr(self, self.mixer_name)
        normed = self.input_layernorm(hidden)
        if self.spec.recurrent:
            hidden = hidden + mixer(normed, layout)
        elif self.spec.needs_layout:
            hidden = hidden + mixer(normed, cos, sin, attend, layout)
        else:
            hidden = hidden + mixer(normed, cos, sin, attend)
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
            DecoderLayer(config, index, spec) for index, spec in enumerate(config.layer_specs())
        )
        self.norm = make_rms_norm(config.hidden_size, config.rms_norm_eps,
                                  config.zero_centered_norms)  # fmt: skip


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
        # a vision-language model's encoder (transformers' ``visual.*``); None: text only
        self.visual = None if config.vision is None else vision_encoder(config.vision)
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
            elif isinstance(module, nn.Conv1d):  # Gated DeltaNet's conv: HF's normal(0, std)
                module.weight.normal_(0.0, std, generator=generator)
            elif isinstance(module, PatchEmbed):  # the vision patches' Conv3d: normal(0, std)
                module.proj.weight.normal_(0.0, std, generator=generator)
                if module.proj.bias is not None:
                    module.proj.bias.zero_()
            elif isinstance(module, nn.LayerNorm):  # the vision blocks' (Qwen3.5)
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, ZeroCenteredRMSNorm):
                module.weight.zero_()
            elif isinstance(module, (RMSNorm, GatedRMSNorm)):
                module.weight.fill_(1.0)
            elif isinstance(module, GatedDeltaNet):
                module.init_state_parameters(generator)
            elif isinstance(module, (SparseMoeBlock, BiasedExpertsMoeBlock)):
                for param in module.parameters():  # router and experts: HF's normal(0, std)
                    param.normal_(0.0, std, generator=generator)
                # DeepSeek's router correction bias, zero as HF's (materialised from meta, it
                # would otherwise hold whatever the memory held, different on every process)
                for buffer in module.buffers():
                    buffer.zero_()
            elif isinstance(module, SinkAttention):  # HF's normal(0, std) sinks
                module.sinks.normal_(0.0, std, generator=generator)

    @property
    def recurrent_layers(self) -> list[int]:
        """Layers whose token mixer keeps a recurrent state instead of K/V (their spec's
        cache kind): the engine keeps a state per sequence for them (engine/cache/kinds.py)."""
        return [i for i, layer in enumerate(self.model.layers) if layer.spec.recurrent]

    @property
    def layout_layers(self) -> list[int]:
        """Layers whose mixer reads the TokenLayout (where the sequences are)."""
        return [i for i, layer in enumerate(self.model.layers) if layer.spec.needs_layout]

    def enable_gradient_checkpointing(self, enabled: bool = True) -> None:
        self.gradient_checkpointing = enabled
        if self.visual is not None:
            self.visual.gradient_checkpointing = enabled

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
        layout: TokenLayout | None = None,
    ) -> torch.Tensor:
        """routed_experts [N, L_sparse, k]: routes to replay, one slice per sparse layer in
        order; router_trace: gets each sparse layer's (router_logits, topk_ids) appended;
        layout: the sequences, for the layers whose mixer runs along them."""
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        sparse_index = 0
        for layer in self.model.layers:
            recorded = None
            if routed_experts is not None and layer.sparse:
                recorded = routed_experts[:, sparse_index]
            if recompute:
                hidden, logits, ids = checkpoint(
                    layer, hidden, cos, sin, attend, recorded, layout, use_reentrant=False
                )
            else:
                hidden, logits, ids = layer(hidden, cos, sin, attend, recorded, layout)
            if layer.sparse:
                sparse_index += 1
                if router_trace is not None:
                    router_trace.append((logits, ids))
        return self.model.norm(hidden)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings [..., H]; with images, the vision encoder's features take the
        places of the image-pad tokens (the images' tokens in order, row by row), or of
        those where image_slots (bool, like input_ids) is True: the prompts' (a sampled
        response may hold the image-pad id)."""
        hidden = self.model.embed_tokens(input_ids)
        if pixel_values is None:
            return hidden
        slots, features = self.image_features(input_ids, pixel_values, image_grid_thw,
                                              image_slots)  # fmt: skip
        return hidden.masked_scatter(slots.unsqueeze(-1), features.to(hidden.dtype))

    def image_features(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        image_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots: bool like input_ids, the tokens the features go to, in order; the vision
        encoder's features [slots, out_hidden]) of the images of ``input_ids`` (embed)."""
        if self.visual is None:
            raise ValueError(f"pixel_values given to a {self.config.model_type} model, which "
                             "has no vision encoder")  # fmt: skip
        if image_grid_thw is None:
            raise ValueError("pixel_values need their image_grid_thw")
        features = self.visual(pixel_values, image_grid_thw)
        slots = input_ids == self.config.vision.image_token_id
        if image_slots is not None:
            slots &= image_slots
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(
                f"the ids hold {int(slots.sum())} image tokens, the images give "
                f"{features.shape[0]} features (image_grid_thw {image_grid_thw.tolist()})"
            )
        return slots, features

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, rows: bool):
        """RoPE's cos/sin for positions, or for mRoPE's three rows [3, ...] when ``rows``."""
        if rows:
            return mrope_cos_sin(self.config, positions, dtype)
        return rope_cos_sin(self.config, positions, dtype)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T], attention_mask [B, T] (left or right padding) -> hidden [B, T, H].
        router_trace: as in forward_packed, with the B*T tokens flattened row by row.
        A vision-language model also takes pixel_values [patches, C*T*P*P] and
        image_grid_thw [images, 3] (the batch's images row by row, as transformers' image
        processor writes them) and mRoPE's position_ids [3, B, T] (computed from the ids
        and grids when not given, models/mrope.py)."""
        if position_ids is not None and (position_ids.dim() != 3 or position_ids.shape[0] != 3):
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must be mRoPE's rows "
                             "[3, B, T] (plain positions come from the attention_mask)")  # fmt: skip
        rows = position_ids is not None or (
            self.config.mrope_section and image_grid_thw is not None
        )
        if position_ids is None and rows:
            vision = self.config.vision
            position_ids = batch_mrope_positions(input_ids, attention_mask, image_grid_thw,
                                                 vision.image_token_id, vision.spatial_merge_size)  # fmt: skip
        elif position_ids is None and attention_mask is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.expand(input_ids.shape)
        elif position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        self._check_window(input_ids.shape[1])
        hidden = self.embed(input_ids, pixel_values, image_grid_thw)
        cos, sin = self._cos_sin(position_ids, hidden.dtype, bool(rows))

        def attend(q, k, v):
            return padded_causal_attention(q, k, v, attention_mask)

        layout = TokenLayout(attention_mask=attention_mask)
        return self._run_layers(hidden, cos, sin, attend, router_trace=router_trace, layout=layout)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in the model dtype ([B, T, num_labels] for
        the sequence-classification variant); images as in forward_hidden."""
        head = self.lm_head if self.lm_head is not None else self.score
        hidden = self.forward_hidden(input_ids, attention_mask, router_trace, pixel_values,
                                     image_grid_thw, position_ids)  # fmt: skip
        return head(hidden)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        routed_experts: torch.Tensor | None = None,
        router_trace: RouterTrace | None = None,
        sequence_group: dist.ProcessGroup | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_slots: torch.Tensor | None = None,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Many sequences concatenated: input_ids/position_ids [N], cu_seqlens int32 [S+1].
        A vision-language model: position_ids may be mRoPE's rows [3, N], and pixel_values /
        image_grid_thw the images of the stream in order (as forward_hidden), image_slots
        [N] bool the tokens their features may go to (embed).

        Returns the final-norm hidden states [N, H] (no lm_head: log-probs are computed from
        them in chunks, see logprobs.py). Attention never crosses a sequence boundary.
        Mixture-of-experts models: routed_experts int [N, L_sparse, k] replays recorded routes
        (moe.NO_ROUTE rows route freely); router_trace, a list, receives each sparse layer's
        (router_logits [N, E], topk_ids [N, k]) for the router losses and metrics.

        sequence_group: Ulysses sequence parallelism (models/sharding/sequence_parallel.py). Then
        input_ids, position_ids and routed_experts are this rank's contiguous slice of a
        stream of SP × N tokens, cu_seqlens and max_seqlen describe that whole stream, and the
        result is the slice's hidden states [N, H]. Images then come as input_embeds [N, H],
        the slice's embeddings with the features of its image tokens scattered in
        (learners/sharding/sequence_shard.sliced_embeddings: the encoder runs on the whole
        images, as an image's tokens may straddle slices), in place of input_ids'."""
        self._check_window(int(max_seqlen))
        if sequence_group is not None and pixel_values is not None:
            raise ValueError("under sequence parallelism a slice's images come as input_embeds "
                             "(sequence_shard.sliced_embeddings), not pixel_values")  # fmt: skip
        if input_embeds is None:
            input_embeds = self.embed(input_ids, pixel_values, image_grid_thw, image_slots)
        hidden = input_embeds
        cos, sin = self._cos_sin(position_ids, hidden.dtype, position_ids.dim() == 2)
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
            self._check_sequence_parallel()
            attend = ulysses_attention(attend, sequence_group)
        layout = None  # built only where a mixer needs it (its token columns cost a host sync)
        if self.layout_layers:
            layout = TokenLayout.packed(cu_seqlens.to(torch.int32), int(max_seqlen),
                                        sequence_group)  # fmt: skip
        return self._run_layers(hidden, cos, sin, attend, routed_experts, router_trace, layout)

    def _check_sequence_parallel(self) -> None:
        """Ulysses splits tokens over ranks and regathers them by heads around attention and
        Gated DeltaNet's mixing (models/sharding/deltanet_parallel.py); an attention-sink
        layer's window runs outside them and would see a slice of each sequence."""
        unsplit = [i for i in self.layout_layers if not self.model.layers[i].spec.recurrent]
        if unsplit:
            raise ValueError(
                f"actor.sequence_parallel_size > 1 cannot run layers {unsplit[:4]}... whose "
                "attention sinks run over a window of each sequence: set "
                "actor.sequence_parallel_size=1 for this model"
            )

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
        from hybridflow.models.heads.sequence_scores import last_token_index

        hidden = self.forward_packed(input_ids, position_ids, cu_seqlens, max_seqlen)  # [N, H]
        last = last_token_index(input_ids, cu_seqlens, pad_token_id)  # [S]
        return self.score(hidden[last]).float()

    # -- io -----------------------------------------------------------------------------------

    def save_pretrained(
        self, save_directory: str, max_shard_size: int = 5 * 1024**3, tokenizer=None
    ) -> None:
        """Write config.json + safetensors (sharded with an index above max_shard_size bytes),
        plus the tokenizer files when a tokenizer is given: a directory transformers loads."""
        from hybridflow.models.checkpoint_io.hf_writer import save_model

        save_model(self, save_directory, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)
