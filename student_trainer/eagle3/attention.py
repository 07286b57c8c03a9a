"""The draft's attention during the training-time test (TTT), in query chunks.

At unroll step k the query of column t (rotated at position t + k) attends to

- the step-0 keys of columns 0..t (causal, padding masked): the draft layer run over the
  target's hidden states, as the prefix's KV cache is at inference;
- the keys of steps 1..k at its own column t only: the chain of tokens the draft has
  proposed from column t, as the tokens it appended to its KV cache are at inference.

This is the attention of SpecForge's `LlamaAttention` with `cache_hidden` and of the EAGLE-3
reference (traineagle3/cnets.py): one softmax over the causal step-0 scores and the k
diagonal scores. Written there, the softmax is a [B, heads, S, S] tensor per step kept for
the backward pass (32 heads at 8k tokens: 8.6 GB in float32, for each of the 7 steps). Here the forward
computes the output and each row's log-sum-exp chunk by chunk of queries, and the backward
recomputes each chunk's scores from the saved inputs (FlashAttention's recomputation, as
SpecForge's `_FlashCachedMergeFunc` does around flash-attn kernels): memory grows with the
chunk, not with S squared. Scores and sums are float32 whatever the inputs' dtype.
"""

from __future__ import annotations

import torch

# Score elements held per chunk (float32): 2^26 is 256 MiB, and bounds the chunk of queries.
CHUNK_SCORES = 1 << 26


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: list[torch.Tensor],
                  vd: list[torch.Tensor], key_valid: torch.Tensor | None, q_offset: int = 0,
                  chunk_scores: int = CHUNK_SCORES) -> torch.Tensor:
    """Attention of queries `q` [B, h, Sq, d] (columns q_offset .. q_offset + Sq) to the step-0
    keys and values `k0`, `v0` [B, h, S0, d] (columns 0 .. S0) causally, and to the diagonal
    keys and values of the later steps, `kd[i]`, `vd[i]` [B, h, Sq, d] (the same columns as the
    queries). `key_valid` [B, S0] marks the step-0 columns that are not padding (None: all).
    Keys and values have as many heads as the queries (grouped heads already repeated)."""
    batch, heads, queries, _ = q.shape
    chunk = max(1, min(queries, chunk_scores // max(1, batch * heads * k0.shape[2])))
    empty = q.new_empty(0, *q.shape)
    kd_stacked = torch.stack(kd) if kd else empty
    vd_stacked = torch.stack(vd) if vd else empty
    valid = key_valid.bool() if key_valid is not None else torch.ones(batch, k0.shape[2], dtype=torch.bool,
                                                                        device=q.device)
    return _TTTAttention.apply(q, k0, v0, kd_stacked, vd_stacked, valid, q_offset, chunk)


def _scores(q, k0, kd, valid, q_offset: int, start: int, stop: int, scale: float):
    """The chunk of queries start..stop (all float32): its step-0 scores [B, h, C, keys] (masked:
    -inf) and diagonal scores [n, B, h, C]; `keys` stops at the chunk's last column."""
    keys = min(k0.shape[2], q_offset + stop)
    q_chunk = q[:, :, start:stop]
    step0 = q_chunk @ k0[:, :, :keys].transpose(-1, -2) * scale
    columns = torch.arange(q_offset + start, q_offset + stop, device=q.device)
    causal = torch.arange(keys, device=q.device)[None, :] <= columns[:, None]
    allowed = causal[None, None] & valid[:, None, None, :keys]
    step0 = step0.masked_fill(~allowed, float("-inf"))
    diagonal = (q_chunk[None] * kd[:, :, :, start:stop]).sum(-1) * scale
    return step0, diagonal, keys


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, valid, q_offset: int, chunk: int):
        scale = q.shape[-1] ** -0.5
        qf, k0f, v0f, kdf, vdf = (t.float() for t in (q, k0, v0, kd, vd))  # cast once, not per chunk
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[2], chunk):
            stop = min(start + chunk, q.shape[2])
            step0, diagonal, keys = _scores(qf, k0f, kdf, valid, q_offset, start, stop, scale)
            chunk_lse = torch.logsumexp(torch.cat([step0, diagonal.permute(1, 2, 3, 0)], dim=-1), dim=-1)
            p0 = torch.exp(step0 - chunk_lse[..., None])
            pd = torch.exp(diagonal - chunk_lse[None])
            out[:, :, start:stop] = p0 @ v0f[:, :, :keys] + (pd[..., None] * vdf[:, :, :, start:stop]).sum(0)
            lse[:, :, start:stop] = chunk_lse
        ctx.save_for_backward(q, k0, v0, kd, vd, valid, out, lse)
        ctx.q_offset, ctx.chunk, ctx.scale = q_offset, chunk, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q_saved, k0_saved, v0_saved, kd_saved, vd_saved, valid, out, lse = ctx.saved_tensors
        q, k0, v0, kd, vd = (t.float() for t in (q_saved, k0_saved, v0_saved, kd_saved, vd_saved))
        scale = ctx.scale
        grad_out = grad_out.float()
        # Softmax backward: dS = P * (dP - rowsum(dO * O)).
        row_dot = (grad_out * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk0 = torch.zeros(k0.shape, dtype=torch.float32, device=q.device)
        dv0 = torch.zeros(v0.shape, dtype=torch.float32, device=q.device)
        dkd = torch.zeros(kd.shape, dtype=torch.float32, device=q.device)
        dvd = torch.zeros(vd.shape, dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[2], ctx.chunk):
            stop = min(start + ctx.chunk, q.shape[2])
            step0, diagonal, keys = _scores(q, k0, kd, valid, ctx.q_offset, start, stop, scale)
            chunk_lse, d_out, dot = lse[:, :, start:stop], grad_out[:, :, start:stop], row_dot[:, :, start:stop]
            q_chunk = q[:, :, start:stop]
            p0 = torch.exp(step0 - chunk_lse[..., None])
            dv0[:, :, :keys] += p0.transpose(-1, -2) @ d_out
            ds0 = p0 * (d_out @ v0[:, :, :keys].transpose(-1, -2) - dot[..., None])
            dq[:, :, start:stop] += ds0 @ k0[:, :, :keys] * scale
            dk0[:, :, :keys] += ds0.transpose(-1, -2) @ q_chunk * scale
            pd = torch.exp(diagonal - chunk_lse[None])
            vd_chunk, kd_chunk = vd[:, :, :, start:stop], kd[:, :, :, start:stop]
            dvd[:, :, :, start:stop] = pd[..., None] * d_out[None]
            dsd = pd * ((d_out[None] * vd_chunk).sum(-1) - dot[None])
            dq[:, :, start:stop] += (dsd[..., None] * kd_chunk).sum(0) * scale
            dkd[:, :, :, start:stop] = dsd[..., None] * q_chunk[None] * scale
        return (dq.to(q_saved.dtype), dk0.to(k0_saved.dtype), dv0.to(v0_saved.dtype), dkd.to(kd_saved.dtype),
                dvd.to(vd_saved.dtype), None, None, None)


# ---- the fused path: one causal kernel per step, the diagonal merged by log-sum-exp -------------
#
# The step-0 scores are causal attention over one sequence, which FlashAttention-style kernels do
# without an [S, S] tensor and with their own recomputing backward; they return each row's
# log-sum-exp. The k diagonal scores of a row are k dot products. One softmax over both is the
# causal output rescaled by exp(lse0 - lse) plus the diagonal values weighted by exp(s_j - lse),
# lse = logsumexp(lse0, s_1..s_k). Its backward is the causal kernel's backward given the merged
# output and the merged lse (the kernel computes dS = P (dP - rowsum(dO O)) with P = exp(S - lse):
# exactly the step-0 block of the joint softmax's gradient) plus the diagonal's, elementwise.
# SpecForge's `_FlashCachedMergeFunc` merges flash-attn kernels the same way.

CAUSAL_KERNELS = ("flash", "cudnn", "math")


def merged_ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kd: list[torch.Tensor],
                         vd: list[torch.Tensor], kernel: str = "flash") -> torch.Tensor:
    """`ttt_attention` for the training unroll (queries at every column, q_offset 0), with
    padding only at the right end (student_trainer/data.py pads so): causality alone then keeps
    every non-padding query off the padding keys. `q`, `k0`, `v0` [B, h, S, d] (grouped heads
    repeated); the diagonal keys and values `kd[i]`, `vd[i]` [B, h_kv, S, d] with h a multiple of
    h_kv (not repeated). `kernel`: "flash" or "cudnn" (PyTorch's CUDA kernels), "math" (explicit
    float32 scores: the CPU's, and a reference)."""
    if kernel not in CAUSAL_KERNELS:
        raise ValueError(f"kernel must be one of {CAUSAL_KERNELS}, not {kernel!r}")
    return _MergedTTTAttention.apply(kernel, q, k0, v0, *kd, *vd)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, h, S, d] viewed as [B, h_kv, h / h_kv, S, d]: the query heads that share a key head."""
    return x.view(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _diagonal_scores(q: torch.Tensor, kd: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, h, S] float32: each query with its own column's key of one later step."""
    return (_grouped(q, kd.shape[1]).float() * kd.float()[:, :, None]).sum(-1).flatten(1, 2) * scale


class _MergedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: str, q, k0, v0, *diagonal):
        steps = len(diagonal) // 2
        kd, vd = diagonal[:steps], diagonal[steps:]
        scale = q.shape[-1] ** -0.5
        out0, lse0, state = _causal_forward(kernel, q, k0, v0, scale)
        scores = [_diagonal_scores(q, k, scale) for k in kd]
        if scores:
            lse = torch.logsumexp(torch.stack([lse0, *scores]), dim=0)
            merged = out0.float() * torch.exp(lse0 - lse)[..., None]
            for s, v in zip(scores, vd):
                weighted = _grouped(torch.exp(s - lse), v.shape[1])[..., None] * v.float()[:, :, None]
                merged += weighted.flatten(1, 2)
            out = merged.to(q.dtype)
        else:
            out, lse = out0, lse0
        ctx.save_for_backward(q, k0, v0, out, lse, *kd, *vd, *scores)
        ctx.kernel, ctx.scale, ctx.steps, ctx.state = kernel, scale, steps, state
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, out, lse, *rest = ctx.saved_tensors
        steps, scale = ctx.steps, ctx.scale
        kd, vd, scores = rest[:steps], rest[steps:2 * steps], rest[2 * steps:]
        grad_out = grad_out.to(out.dtype)
        dq, dk0, dv0 = _causal_backward(ctx.kernel, grad_out, q, k0, v0, out, lse, scale, ctx.state)
        if not steps:
            return None, dq, dk0, dv0
        dq = dq.float()
        row_dot = (grad_out.float() * out.float()).sum(-1)  # what the causal kernel subtracts too
        q_grouped, d_out = _grouped(q, kd[0].shape[1]).float(), _grouped(grad_out, kd[0].shape[1]).float()
        dkd, dvd = [], []
        for s, k, v in zip(scores, kd, vd):
            p = _grouped(torch.exp(s - lse), k.shape[1])  # [B, h_kv, g, S]
            dvd.append((p[..., None] * d_out).sum(2).to(v.dtype))
            ds = p * ((d_out * v.float()[:, :, None]).sum(-1) - _grouped(row_dot, k.shape[1]))
            dq += (ds[..., None] * k.float()[:, :, None]).flatten(1, 2) * scale
            dkd.append(((ds[..., None] * q_grouped).sum(2) * scale).to(k.dtype))
        return None, dq.to(q.dtype), dk0, dv0, *dkd, *dvd


def _causal_forward(kernel: str, q, k, v, scale: float):
    """Causal attention's output [B, h, S, d] (q's dtype), each row's log-sum-exp [B, h, S]
    (float32), and what the kernel's backward needs besides."""
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        # Some builds round the log-sum-exp's rows up to a block: the backward gets that shape back.
        return out, lse[..., :q.shape[2]], (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)
    if kernel == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        return out, lse.reshape(q.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    lse = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)
    # The same scores again below (the backward's recomputation): the CPU's tiny sizes only.
    return (_math_probabilities(q, k, lse, scale) @ v.float()).to(q.dtype), lse, None


def _math_probabilities(q, k, lse, scale: float) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return torch.exp(scores - lse[..., None]).masked_fill(~causal, 0.0)


def _causal_backward(kernel: str, grad_out, q, k, v, out, lse, scale: float, state):
    """The causal block's gradients given the output and log-sum-exp of the whole softmax."""
    if kernel == "flash":
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = state
        if lse.shape != lse_shape:
            lse = torch.nn.functional.pad(lse, (0, lse_shape[-1] - lse.shape[-1]))
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    if kernel == "cudnn":
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
            True, scale=scale)
    p = _math_probabilities(q, k, lse, scale)
    d_out = grad_out.float()
    row_dot = (d_out * out.float()).sum(-1)
    ds = p * (d_out @ v.float().transpose(-1, -2) - row_dot[..., None])
    return ((ds @ k.float()) * scale).to(q.dtype), ((ds.transpose(-1, -2) @ q.float()) * scale).to(k.dtype), \
        (p.transpose(-1, -2) @ d_out).to(v.dtype)
