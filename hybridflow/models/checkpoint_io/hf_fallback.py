"""Any transformers causal LM behind CausalLM's interface (the slower path).

Used by load_model for architectures our decoder does not implement, so a user's model never
simply fails to load. Slower because: forward_packed re-pads the packed tokens into a
[S, max_seqlen] batch (compute on padding), no fused varlen attention, and the generation
engine cannot read its layers (it needs our CausalLM), so rollout falls back to HF generate.

Parameter names equal the HF model's (its submodules are registered directly on the wrapper).
`.config` is the transformers config object (same field names as ModelArchitecture for the shared
fields: vocab_size, hidden_size, num_hidden_layers, tie_word_embeddings, eos_token_id...).
"""

from __future__ import annotations

import torch
from torch import nn


class HFCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        # Not registered as a child (that would prefix every name with "hf_model.").
        object.__setattr__(self, "hf_model", hf_model)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.config = hf_model.config
        self.attention_backend = "hf"
        self._gradient_checkpointing = False

    @property
    def gradient_checkpointing(self) -> bool:
        return self._gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self._gradient_checkpointing = enabled
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the
        # old names warn, and go in v6); older releases have only the old names
        model = self.hf_model
        if enabled and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        elif enabled:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        elif hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()

    def enable_gradient_checkpointing(self, enabled: bool = True) -> None:
        self.gradient_checkpointing = enabled

    def train(self, mode: bool = True):
        super().train(mode)
        self.hf_model.training = mode
        return self

    @property
    def output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; positions from the mask as in CausalLM."""
        return self.output_embeddings(self.forward_hidden(input_ids, attention_mask))

    def forward_hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        position_ids = None
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        base = self.hf_model.get_decoder()
        out = base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return out.last_hidden_state  # [B, T, H], final norm applied

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
    ) -> torch.Tensor:
        """Packed [N] -> hidden [N, H] by re-padding to [S, max_seqlen] (right padding).

        position_ids are assumed to be 0..len-1 within each sequence."""
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [S]
        num_seqs = lengths.shape[0]
        columns = torch.arange(int(max_seqlen), device=input_ids.device)
        valid = columns[None, :] < lengths[:, None]  # [S, T]
        padded = torch.zeros(
            num_seqs, int(max_seqlen), dtype=input_ids.dtype, device=input_ids.device
        )
        padded[valid] = input_ids
        hidden = self.forward_hidden(padded, valid.long())
        return hidden[valid]

    def save_pretrained(
        self, save_directory: str, max_shard_size: int = 5 * 1024**3, tokenizer=None
    ):
        self.hf_model.save_pretrained(save_directory, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_directory)


def load_hf_model(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> HFCausalLM:
    from transformers import AutoModelForCausalLM

    from hybridflow.model_config_values import ModelConfigError, config_values_message
    from hybridflow.models.checkpoint_io.finite_weights import check_all_finite
    from hybridflow.models.checkpoint_io.loadability import (
        CONFIG_FILE,
        read_config_json,
        transformers_name_problems,
    )

    problems = transformers_name_problems(read_config_json(path))
    if problems:  # said before transformers looks them up by name (a KeyError there)
        raise ModelConfigError(config_values_message(problems, f"{path}/{CONFIG_FILE}"))
    hf_model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa"
    ).to(device)
    check_all_finite(hf_model.named_parameters(), path)  # buffers may hold -inf masks
    return HFCausalLM(hf_model)
