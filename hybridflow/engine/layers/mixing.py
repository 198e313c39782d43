"""The token mixer of one layer in the engine's eager passes (prefill.py, layers/eager.py),
by the kind its LayerSpec names: a K/V kind (attention, gated attention) projects, stores its
k/v and attends; a recurrent kind (Gated DeltaNet) runs its prefill, extend or decode op on
the sequences' states, read and written by slot (cache/kinds.py).

Rows whose state must not move (a finished row still stepping until the host reads it back,
a padding row) write to the scratch slot: ``write_slots`` below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.models.mixers.gated_deltanet import RecurrentState, TokenLayout


def kv_mixer(layer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             store: Callable, attend: Callable) -> torch.Tensor:  # fmt: skip
    """A K/V layer's mixer output: q/k/v projected (RoPE, norms), k/v stored, attention, the
    output gate where the mixer has one (gated attention), o_proj."""
    mixer = getattr(layer, layer.mixer_name)
    q, k, v, *gate = mixer.project_qkv(normed, cos, sin)
    store(k, v)
    out = attend(q, k, v)
    if gate:
        out = out * torch.sigmoid(gate[0])
    return mixer.o_proj(out.flatten(-2))


def write_slots(slots: torch.Tensor, frozen: torch.Tensor | None, scratch: int) -> torch.Tensor:
    """Where each row's new state goes: its slot, or the scratch slot for frozen rows."""
    if frozen is None:
        return slots
    return torch.where(frozen, torch.full_like(slots, scratch), slots)


def recurrent_prefill(layer, normed: torch.Tensor, layout: TokenLayout, states,
                      index: int, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Packed prompts from a zero state (the mixer's prefill: fla's chunk kernel on CUDA);
    each sequence's final state into its slot (slots [S])."""
    out, state = getattr(layer, layer.mixer_name).prefill(normed, layout)
    conv, ssm = states.layer(index)
    conv[slots] = state.conv.to(conv.dtype)
    ssm[slots] = state.ssm.to(ssm.dtype)
    return out


def recurrent_extend(layer, normed: torch.Tensor, layout: TokenLayout, states, index: int,
                     slots: torch.Tensor, targets: torch.Tensor,
                     fresh: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Packed new tokens of S sequences continuing from their slots' states (slots [S]); a
    sequence that starts at position 0 (fresh [S]) from zeros; the final states to targets."""
    conv, ssm = states.layer(index)
    keep = (~fresh).to(ssm.dtype)
    state = RecurrentState(conv[slots] * keep.to(conv.dtype)[:, None, None],
                           ssm[slots] * keep[:, None, None, None])  # fmt: skip
    out = getattr(layer, layer.mixer_name).extend(normed, layout, state)
    conv[targets] = state.conv
    ssm[targets] = state.ssm.to(ssm.dtype)
    return out


def recurrent_decode(layer, normed: torch.Tensor, states, index: int, slots: torch.Tensor,
                     targets: torch.Tensor, step: str = "torch", launch=None) -> torch.Tensor:  # fmt: skip
    """One token of each row [B, H]: the state read from slots [B], written to targets [B].
    step: "torch" (the mixer's own decode op on gathered states), "triton" (the conv, gates,
    delta rule and gated norm in two kernels on the states in place: kernels/delta_step.py;
    launch: its DeltaStepLaunch, None for the default) or "triton-grouped" (the former
    one-kernel layout, the gates and norm in torch: kernels/delta_step_grouped.py, which
    benchmarks/delta_step.py times against)."""
    mixer = getattr(layer, layer.mixer_name)
    conv, ssm = states.layer(index)
    if step == "torch":
        state = RecurrentState(conv[slots], ssm[slots])
        out = mixer.decode(normed, state)
        conv[targets] = state.conv
        ssm[targets] = state.ssm.to(ssm.dtype)
        return out
    if step == "triton-grouped":
        from hybridflow.engine.kernels.delta_step_grouped import delta_rule_step

        g, beta = mixer.gates(normed)
        core = delta_rule_step(mixer.in_proj_qkv(normed), conv, mixer.conv1d.weight, ssm, g,
                               beta, slots, targets, mixer.num_k_heads)  # fmt: skip
        return mixer.output(core.to(normed.dtype), normed)
    from hybridflow.engine.kernels.delta_step import DeltaParams, DeltaStepLaunch, gated_delta_step

    mixed, a, b, z = (proj(normed) for proj in (mixer.in_proj_qkv, mixer.in_proj_a,
                                                   mixer.in_proj_b, mixer.in_proj_z))  # fmt: skip
    gated = gated_delta_step(mixed, a, b, z, conv, ssm, slots, targets, DeltaParams.of(mixer),
                             launch or DeltaStepLaunch())  # fmt: skip
    return mixer.out_proj(gated)


def packed_layout(token_slots: torch.Tensor, position_ids: torch.Tensor):
    """The sequences of an extend pass's tokens (each sequence's tokens contiguous, one slot
    each): (TokenLayout, slots [S], fresh [S]: starts at position 0). One host sync."""
    slots, counts = torch.unique_consecutive(token_slots, return_counts=True)
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=token_slots.device)
    cu[1:] = counts.cumsum(0)
    layout = TokenLayout.packed(cu, int(counts.max()))
    return layout, slots, position_ids[cu[:-1].long()] == 0
