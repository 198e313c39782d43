"""The gated delta rule (Gated DeltaNet's token mixing), as pure functions.

Per value head, with a state S [Dk, Dv] that starts at zero for every sequence:

    S_t = exp(g_t) * S_{t-1}                          (decay, g_t <= 0)
    S_t = S_t + k_t (beta_t * (v_t - k_t^T S_t))^T    (delta rule: correct what S predicts)
    o_t = S_t^T q_t / sqrt(Dk)

q and k are L2-normalised first; key heads serve consecutive groups of value heads.

- :func:`recurrent_gated_delta_rule`: the loop above, token by token (the reference and the
  engine's decode step).
- :func:`chunked_gated_delta_rule`: the same sums in chunks of C tokens (WY form: one
  triangular solve per chunk, matmuls inside it, the state carried between chunks); what the
  trainer runs on a CPU. Its backward is autograd's.
- :func:`packed_gated_delta_rule`: many sequences concatenated (cu_seqlens, as the trainer
  packs them): fla-core's Triton kernel on CUDA when it is installed, else the chunked torch
  path on the sequences laid out as rows. No state crosses a sequence boundary.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # fla's l2norm epsilon (transformers' reference uses the same)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_key_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hv, D]: key head h serves value heads h*G .. h*G + G - 1."""
    groups = value_heads // x.shape[-2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-2)


def _prepare(q, k, v, g, beta, normalize: bool):
    """fp32 copies (fp64 stays fp64: the tests' reference) with q/k normalised and expanded
    to the value heads."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if normalize:
        q, k = l2_normalize(q), l2_normalize(k)
    heads = v.shape[-2]
    return expand_key_heads(q, heads), expand_key_heads(k, heads), v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k [B, T, Hk, Dk], v [B, T, Hv, Dv], g/beta [B, T, Hv] -> (out [B, T, Hv, Dv] fp32,
    final state [B, Hv, Dk, Dv] fp32), one token at a time."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    batch, length, heads, dk = k.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    if initial_state is not None:
        state = initial_state.to(q.dtype)
    q = q * dk**-0.5
    outputs = []
    for t in range(length):
        state = state * g[:, t, :, None, None].exp()
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outputs, dim=1), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and results as :func:`recurrent_gated_delta_rule`, computed per chunk.

    Inside a chunk, with G_i the cumulative log decay up to token i, the delta rule's
    corrections solve (I + L) u = beta * v, where L_ij = beta_i k_i.k_j exp(G_i - G_j) for
    j < i: u are the values actually written, and w (the same solve of beta k exp(G)) reads
    the carried state S. Then, per chunk in order: v' = u - w S, o = (q exp(G)) S + (masked
    decayed q k^T) v', and S = exp(G_last) S + (k exp(G_last - G))^T v'."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    # [B, H, N, C, D]; padded tokens have k = v = 0 and g = 0, so they change nothing
    q, k, v = (
        F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk_size))
        for x in (q * dk**-0.5, k, v)
    )
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk_size))
               for x in (g, beta))  # fmt: skip
    decay = g.cumsum(-1)  # G [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf"))
    pair_decay = pair_decay.exp()  # exp(G_i - G_j), j <= i; 0 above the diagonal
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2) * pair_decay).tril(-1)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    solve = functools.partial(torch.linalg.solve_triangular, eye + lower, upper=False,
                              unitriangular=True)  # fmt: skip
    written = solve(v * beta[..., None])  # u [B, H, N, C, Dv]
    reads = solve(k_beta * decay[..., None].exp())  # w [B, H, N, C, Dk]
    inner = q @ k.transpose(-1, -2) * pair_decay
    q_decayed = q * decay[..., None].exp()
    last = decay[..., -1:]  # [B, H, N, 1]
    k_to_end = k * (last - decay).exp()[..., None]
    state = (
        q.new_zeros(batch, heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    )
    outputs = []
    for n in range(q.shape[2]):
        corrected = written[:, :, n] - reads[:, :, n] @ state
        outputs.append(q_decayed[:, :, n] @ state + inner[:, :, n] @ corrected)
        state = (
            state * last[:, :, n, :, None].exp() + k_to_end[:, :, n].transpose(-1, -2) @ corrected
        )
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length]  # [B, H, T, Dv]
    return out.transpose(1, 2), state


def rows_of_packed(cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each packed token [N] when the sequences of ``cu_seqlens`` are laid
    out as rows of ``max_seqlen`` columns (right-padded)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
    columns = torch.arange(int(cu_seqlens[-1]), device=starts.device) - starts[rows]
    return rows, columns


def packed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: str = "auto",
    final_state: bool = False,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q/k [N, Hk, Dk], v [N, Hv, Dv], g/beta [N, Hv] of packed sequences -> out [N, Hv, Dv]
    in v's dtype (and, with ``final_state``, each sequence's last state [S, Hv, Dk, Dv] fp32:
    what a prefill hands the decode steps). initial_state [S, Hv, Dk, Dv]: each sequence's
    state before its first token (None: zeros; the engine's continued sequences). backend:
    "fla" (fla-core's chunk kernel, CUDA), "torch" (chunked reference on the sequences as
    rows) or "auto" (fla where it is importable on CUDA)."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta))
    if resolve_delta_backend(backend, q.device, v.dtype, needs_grad) == "fla":
        out, state = fla_packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens, final_state,
                                                 initial_state)  # fmt: skip
        return (out, state) if final_state else out
    rows, columns = rows_of_packed(cu_seqlens, max_seqlen)
    num_rows = len(cu_seqlens) - 1

    def as_rows(x: torch.Tensor) -> torch.Tensor:
        grid = x.new_zeros(num_rows, max_seqlen, *x.shape[1:])
        return grid.index_put((rows, columns), x)

    # right padding: a row's padded tail comes after its tokens, so it reaches none of them;
    # and with k = v = beta = g = 0 there it leaves the row's last state as it was. Without
    # gradients (the engine's passes) chunks are no longer than the longest row: a pass of a
    # few tokens a row (a decode-sized extend, a draft model's step) would otherwise pad each
    # row to 64 tokens. Training keeps 64 whatever the lengths, so its rounding does not
    # depend on how a layout cuts the stream (Ulysses ranks see other max_seqlen values).
    chunk = 64 if needs_grad else min(64, max_seqlen)
    out, state = chunked_gated_delta_rule(*(as_rows(x) for x in (q, k, v, g, beta)),
                                          initial_state=initial_state, chunk_size=chunk)  # fmt: skip
    out = out[rows, columns].to(v.dtype)
    return (out, state) if final_state else out


DELTA_BACKENDS = ("auto", "fla", "torch")


def resolve_delta_backend(
    backend: str,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    needs_grad: bool = False,
) -> str:
    """The backend "auto" means here: fla-core's kernel on CUDA for 16-bit inputs (it refuses
    fp32 q/k/v) when fla is importable and, where gradients flow, its backward is sound on
    this GPU (fla_backward_problem); else the chunked torch reference."""
    if backend not in DELTA_BACKENDS:
        raise ValueError(f"gated delta rule backend {backend!r} is not one of {DELTA_BACKENDS}")
    half = dtype in (torch.bfloat16, torch.float16)
    if backend == "auto":
        usable = device.type == "cuda" and half and _fla_chunk() is not None
        if usable and needs_grad and (problem := fla_backward_problem(device)):
            warnings.warn(
                f"gated delta rule: the chunked torch reference trains here: {problem}",
                stacklevel=3,
            )
            usable = False
        return "fla" if usable else "torch"
    if backend == "fla" and _fla_chunk() is None:
        raise ImportError(
            "the 'fla' gated delta rule backend needs fla-core (pip install fla-core); "
            "backend='torch' runs the chunked reference instead"
        )
    if backend == "fla" and not half:
        raise ValueError(f"fla-core's gated delta rule takes bf16/fp16 inputs, not {dtype}: "
                         "run under bf16 autocast, or use backend='torch'")  # fmt: skip
    if backend == "fla" and needs_grad and (problem := fla_backward_problem(device)):
        raise RuntimeError(f"{problem}; or train with backend='torch'")
    return backend


def fla_backward_problem(device: torch.device) -> str | None:
    """Why fla-core's gated backward cannot run on this GPU, or None. fla refuses it on Hopper
    with Triton >= 3.4.0 and < 3.7.1, whose compiler gives wrong gradients in chunk_bwd_dqkwg
    (fla's issue 640; seen on an H100 with Triton 3.6), unless tilelang's kernel replaces it.
    Asked before the forward, so a run falls back at once instead of failing in backward."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    import triton

    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:3])
    if not (3, 4, 0) <= version < (3, 7, 1) or importlib.util.find_spec("tilelang"):
        return None
    return (
        f"fla-core's gated backward is wrong on Hopper GPUs with Triton {triton.__version__} "
        "(fixed in Triton >= 3.7.1, or pip install tilelang)"
    )


@functools.cache
def _fla_chunk():
    """fla-core's chunk_gated_delta_rule, or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens, final_state: bool = False,
                                initial_state: torch.Tensor | None = None):  # fmt: skip
    """fla-core's varlen chunk kernel: one batch row [1, N, H, D] with ``cu_seqlens`` (int64),
    the state reset at each boundary; it normalises q/k itself (use_qk_l2norm_in_kernel) and
    scales q by Dk^-0.5 by default. Key heads are expanded to the value heads first (older
    fla releases need H equal for q, k and v). -> (out [N, Hv, Dv], the sequences' last
    states [S, Hv, Dk, Dv] or None)."""
    heads = v.shape[-2]
    q, k = expand_key_heads(q, heads), expand_key_heads(k, heads)
    out, state = _fla_chunk()(
        q[None].contiguous(),
        k[None].contiguous(),
        v[None].contiguous(),
        g[None].float(),
        beta[None].to(v.dtype),
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=final_state,
        cu_seqlens=cu_seqlens.long(),
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state
