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
