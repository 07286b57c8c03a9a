"""Attention with a learned sink per head (gpt-oss: sliding-window layers alternating with full ones)
through one fused FlexAttention kernel.

A sink is one more logit in each query's softmax that has no value: the weights of the real keys are
exp(s_i) / (sum_j exp(s_j) + exp(sink)). transformers' eager attention for gpt-oss writes the
[B, H, S, S + 1] scores out (32 GiB at 4 x 8192 for gpt-oss-20b), and its SDPA path is refused for
the model. Here FlexAttention computes the attention without the sink and returns each row's
log-sum-exp (lse); the sink then only rescales the row:

    out = flex_out * sum_j exp(s_j) / (sum_j exp(s_j) + exp(sink)) = flex_out * sigmoid(lse - sink)

in float32, exact, and fused into the same compiled layer. The causal and sliding-window masks are
block masks built from their structure (which 128 x 128 blocks are wholly inside the mask, which
straddle its edge), never from the S x S grid, once per forward for each kind of layer, with the
padding of the pack where it has any. A mask transformers derives otherwise (packed sequences,
a cache, an extra mask function) is built from transformers' own mask function, point by point:
correct, slower, and never on the runner's path.

On a GPU FlexAttention runs compiled (inside the decoder layers that model loading compiles on one
GPU, or alone under tensor parallelism); on a CPU, eagerly (it then computes the scores whole: fine
for the tests' tiny models).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

IMPLEMENTATION = "distill_flex_sinks"
BLOCK = 128  # FlexAttention's default block: a mask's unit

_compiled_flex = None


def has_sinks(model: nn.Module) -> bool:
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def install(model: nn.Module) -> bool:
    """Routes the attention of a model with attention sinks through `sink_attention`; False (nothing
    changed) for a model without sinks, whose attention runs as transformers chose (SDPA)."""
    if not has_sinks(model):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sink_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, block_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    return True


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def sink_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, dropout: float = 0.0,
                   sliding_window: int | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention interface: query [B, Hq, S, D], key and value [B, Hkv, S, D] ->
    ([B, S, Hq, D], None)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if dropout and module.training:
        raise ValueError("attention dropout is for training; the teacher's model runs in eval mode")
    if attention_mask is None:
        attention_mask = structured_block_mask(query.shape[0], query.shape[2], sliding_window, None, query.device)
    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"{IMPLEMENTATION} takes the block mask its mask function builds, not a "
                        f"{type(attention_mask).__name__}: leave attention_mask a 2-D padding mask or None")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and heads & (heads - 1):
        # FlexAttention's grouped-query path wants a power-of-two head count: repeat K and V instead.
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    kwargs_flex = dict(block_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != heads)
    if query.device.type == "cuda":
        out, lse = _with_lse(_flex(), query, key, value, kwargs_flex)
    elif torch.compiler.is_compiling():  # a compiled layer: the compiler fuses it
        out, lse = _with_lse(flex_attention, query, key, value, kwargs_flex)
    else:
        with warnings.catch_warnings():  # "called without torch.compile()": on a CPU, eager is the point
            warnings.simplefilter("ignore", UserWarning)
            out, lse = _with_lse(flex_attention, query, key, value, kwargs_flex)
    if s_aux is not None:
        keep = torch.sigmoid(lse.float() - s_aux.float().view(1, -1, 1))
        out = (out.float() * keep.unsqueeze(-1)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _with_lse(flex, query, key, value, kwargs):
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before 2.9: the log-sum-exp is the second output
        return flex(query, key, value, return_lse=True, **kwargs)
    out, aux = flex(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


# ---- masks ------------------------------------------------------------------------------------

def _mask_mod(window: int | None, padding: torch.Tensor | None):
    """The mask inside a block that straddles its edge: causal, within the window, not padding."""
    def mask_mod(batch, head, q, kv):
        allowed = kv <= q
        if window is not None:
            allowed = allowed & (q - kv < window)
        if padding is not None:
            allowed = allowed & padding[batch, kv]
        return allowed

    return mask_mod


def structured_block_mask(batch: int, length: int, window: int | None, padding: torch.Tensor | None,
                          device: torch.device, block: int = BLOCK):
    """The causal (and, given `window`, sliding-window) block mask of `length` queries over as many
    keys, keys marked False in `padding` [B, length] left out, from the blocks' bounds alone."""
    from torch.nn.attention.flex_attention import BlockMask

    blocks = math.ceil(length / block)
    index = torch.arange(blocks, device=device)
    q_first, q_last = (index * block).view(-1, 1), ((index + 1) * block - 1).clamp(max=length - 1).view(-1, 1)
    k_first, k_last = (index * block).view(1, -1), ((index + 1) * block - 1).clamp(max=length - 1).view(1, -1)
    some = k_first <= q_last  # some (query, key) pair of the two blocks is causal
    every = (k_last <= q_first) & ((index + 1) * block <= length).view(1, -1)  # every pair, no ragged tail
    if window is not None:
        some = some & (k_last > q_first - window)
        every = every & (k_first > q_last - window)
    some, every = some.unsqueeze(0), every.unsqueeze(0)  # [1, q blocks, kv blocks]
    if padding is not None:
        keys = torch.zeros(padding.shape[0], blocks * block, dtype=torch.bool, device=device)
        keys[:, :length] = padding.to(device=device, dtype=torch.bool)
        keys = keys.view(padding.shape[0], blocks, block)
        some = some & keys.any(-1).unsqueeze(1)
        every = every & keys.all(-1).unsqueeze(1)
    partial = some & ~every

    def ordered(chosen):  # counts [B, 1, q blocks] and the chosen kv blocks first [B, 1, q blocks, kv blocks]
        counts = chosen.sum(-1, dtype=torch.int32).unsqueeze(1)
        indices = torch.argsort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, indices.unsqueeze(1)

    (partial_count, partial_index), (full_count, full_index) = ordered(partial), ordered(every)
    return BlockMask.from_kv_blocks(partial_count, partial_index, full_count, full_index, BLOCK_SIZE=block,
                                    mask_mod=_mask_mod(window, padding), seq_lengths=(length, length))


def block_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=None, attention_mask: torch.Tensor | None = None, device="cpu",
               local_size: int | None = None, allow_is_causal_skip: bool = True, use_vmap: bool = False, **kwargs):
    """transformers' mask interface for `IMPLEMENTATION`: the layer kind's block mask."""
    padding = attention_mask  # [B, kv_length] bool, or None without padding (never read on the host: no sync)
    plain = (not use_vmap and allow_is_causal_skip and q_length == kv_length and not isinstance(q_offset, torch.Tensor)
             and q_offset == 0 and kv_offset == 0)
    if plain:
        return structured_block_mask(batch_size, q_length, local_size, padding, torch.device(device))
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.masking_utils import (add_offsets_to_mask_function, and_masks, padding_mask_function,
                                            prepare_padding_mask)

    mask = mask_function
    if padding is not None:
        mask = and_masks(mask, padding_mask_function(prepare_padding_mask(padding, kv_length, kv_offset)))
    mask = add_offsets_to_mask_function(mask, q_offset, kv_offset)
    return create_block_mask(mask, batch_size, None, q_length, kv_length, device=device, _compile=False)
