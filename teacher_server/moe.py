"""The teacher's mixture-of-experts layers: the experts' forward of every transformers MoE model
(qwen3_moe, gpt_oss, mixtral, deepseek_v3, and any other whose experts class carries transformers'
`@use_experts_implementation`), and how many tokens each expert of each layer receives.

transformers keeps an MoE layer's experts as 3-D parameters (`gate_up_proj` [E, 2I, H] or, for
`is_transposed` layouts such as gpt-oss, [E, H, 2I]; `down_proj` likewise) and dispatches their
forward through its `ExpertsInterface` by `config._experts_implementation`. The router stays the
model's own (softmax then top-k for Qwen3 and Mixtral, top-k then softmax for gpt-oss,
DeepSeek-V3's grouped sigmoid routing with its correction bias): it decides the outputs, and it is a
few small kernels (a softmax-then-top-k router's two of them in one on a GPU,
teacher_server/routing.py). `install` registers this module's forward there, under `IMPLEMENTATION`. Per
layer it runs, on T tokens routed to k experts each:

    one permutation   the T x k (token, expert) pairs sorted by expert (a stable sort of T x k
                      ids), the tokens' rows gathered once in that order, the count of pairs per
                      expert (a histogram: no host sync) and its cumulative sum, the group offsets
    two grouped GEMMs [T x k, H] x gate_up[E] and [T x k, I] x down[E]: every expert in one launch
                      (`torch._grouped_mm`, which reads the offsets on the device)
    the gate          the expert's activation (its `_apply_gate`, biases gathered by expert), the
                      routing weight folded in before the down product (it is linear: the same
                      sum, on I columns instead of H)
    one combine       each token's k rows gathered back and summed in float32

No per-expert loop, no `.item()`, nothing that waits for the device: the engine keeps launching
the next layer while the GPU works. transformers' own `grouped_mm` (its default) does the same
products but gathers and scatters [T x k, H] twice more and applies the weights after the down
product; bench/moe_teacher.py measures both. On a device or dtype that `torch._grouped_mm` does not
run (a float32 model on a GPU, strides that are not 16-byte multiples on a CPU), the products run
one expert at a time, reading the group sizes back to the host once per layer: correct, slower,
and logged once at install.

On a GPU and one process, model loading compiles each decoder layer (dynamic shapes): the
norms, the rotary embedding, the router's softmax/top-k and this module's gather, gate and
combine fuse into a few kernels around the products. Under tensor parallelism the layers run
eagerly (their collectives run in hooks between the linears).

Under expert parallelism (teacher_server/parallel.py's ExpertShard) a rank holds E / N experts
(`expert_range`); every rank sees every token and its routing, sorts its own experts' pairs first
(the ids rotated by its first expert), runs the products over those groups only and masks the
other pairs at the combine; an all-reduce after the forward adds the ranks' outputs.

FP8 experts (teacher_server/fp8_experts.py: --quantize fp8, or a published FP8 checkpoint) replace
the 3-D weights by modules that compute their own grouped product from the same offsets, with the
permutation and the combine's order inside it: the first product reads each sorted pair's token
row by index (no gathered copy; the activation is quantized once per token), the second writes
each product to its pair's row in token order, so the combine is a sum over each token's k
contiguous rows (a model with expert biases or a norm after each expert keeps the combine above).

Expert load (`ExpertLoad`): the histogram each layer computes anyway is written into one row of a
[layers, experts] tensor on the device; the runner adds it to a running total after each forward
(one kernel). /metrics and /v1/status read them, so an operator sees when routing, not the GPU,
bounds the teacher (teacher_server/metrics.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from teacher_server import routing

log = logging.getLogger(__name__)

IMPLEMENTATION = "distill_grouped"
# transformers' name for the dense, one-expert-at-a-time forward: what the tests hold this one to.
EAGER = "eager"

FP8 = torch.float8_e4m3fn
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# torch._grouped_mm reads its operands with 16-byte aligned loads (its CPU kernel refuses others).
_ALIGN_BYTES = 16


class MoeUnsupported(ValueError):
    """A mixture-of-experts model whose experts this module cannot run; the message says what to do."""


# ---- the experts' forward ---------------------------------------------------------------------

def _grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs `x` [M, K] x `weight` [E, K, N] as they are laid out."""
    if _GROUPED_MM is None or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        # CUDA's kernel is bf16 (sm80 and later); float32 would need another kernel.
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    n = weight.shape[-1]
    strides_ok = all(stride * size % _ALIGN_BYTES == 0 for t in (x, weight)
                     for stride, dim in zip(t.stride(), t.shape) if stride != 1 and dim > 1)
    if torch.compiler.is_compiling():
        # A traced tensor has no address (the compiler's buffers are aligned), and the operator's
        # shape function accepts bf16 only.
        return strides_ok and n * size % _ALIGN_BYTES == 0 and x.dtype == torch.bfloat16
    return (strides_ok and n * size % _ALIGN_BYTES == 0 and x.data_ptr() % _ALIGN_BYTES == 0
            and weight.data_ptr() % _ALIGN_BYTES == 0)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [M, K] sorted by group, times their group's `weight` [E, K, N]: [M, N]. `offsets`
    (int32 [E]) is where each group's rows end (the cumulative group sizes)."""
    if _grouped_mm_runs(x, weight):
        return _GROUPED_MM(x, weight, offs=offsets)
    return grouped_mm_per_group(x, weight, offsets)


def grouped_mm_per_group(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same product one group at a time: the group sizes are read back to the host (a sync)."""
    out = x.new_empty(x.shape[0], weight.shape[-1])
    start = 0
    for group, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[group], out=out[start:end])
        start = end
    return out


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E]: how many of `expert_ids` name each expert, without a host sync (CUDA's bincount
    reads its input's maximum back to the host; its histc does not)."""
    if expert_ids.device.type == "cuda":
        return torch.histc(expert_ids.int(), bins=num_experts, min=0, max=num_experts - 1).int()
    return torch.bincount(expert_ids, minlength=num_experts).int()


@dataclass(frozen=True)
class ExpertRange:
    """The experts a rank holds under expert parallelism (teacher_server/parallel.py's ExpertShard):
    global experts `first` .. `first + count - 1` of `total`."""

    first: int
    count: int
    total: int


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: `hidden_states` [T, H], the router's choice `top_k_index`
    [T, k] and its weights [T, k] -> the weighted sum of each token's experts' outputs [T, H].

    Under expert parallelism (`self.expert_range` set) every rank holds the same tokens and their
    routing, and runs only the pairs routed to its own experts; the pairs of other ranks' experts
    give zeros, and the ranks' partial sums are added by the all-reduce after this forward."""
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    span: ExpertRange | None = getattr(self, "expert_range", None)
    if span is None:
        num_experts, key = self.num_experts, ids
    else:
        # This rank's experts first (0 .. count - 1), the others after them: the global ids rotated.
        num_experts, key = span.total, (ids - span.first) % span.total
    # One permutation: the (token, slot) pairs in expert order; stable, so a token's pairs keep
    # their slot order within an expert (the result does not depend on it, determinism does).
    # The keys as the narrowest integers that hold them: CUDA's radix sort makes one pass per key byte
    # (eight over int64 ids: 54 us a layer at Qwen3-30B-A3B's 65,536 pairs).
    narrow = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32767 else key.dtype
    order = torch.argsort(key.to(narrow), stable=True)
    counts = count_per_expert(key, num_experts)
    load = getattr(self, "expert_load_row", None)
    if load is not None:
        load.copy_(counts if span is None else counts.roll(span.first))  # in global expert order
    local = None
    if span is not None:
        # Groups past this rank's experts are left out of the products: their rows are never read and
        # their output rows are never written (whatever memory held), so they are masked at the combine.
        counts = counts[:span.count]
        sorted_key = key.index_select(0, order)
        local = sorted_key < span.count
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    token_of_pair = order // k
    sorted_experts = None
    if self.has_bias:
        sorted_experts = ids.index_select(0, order) if span is None else sorted_key.clamp(max=span.count - 1)
    pair_weights = top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)

    first = self.gate_up_proj if self.has_gate else self.up_proj
    first_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    post_norm = getattr(self, "has_post_expert_norm", False)
    if getattr(first, "gate_group", 0) and isinstance(self.down_proj, nn.Module) and not (self.has_bias or post_norm):
        # FP8 experts of a plain SwiGLU gate with its rows interleaved (fp8_experts.interleave_gate): the
        # gate and the routing weight in the first product's epilogue, its [M, I] output quantized for
        # the second, which writes each pair's row in token order; the combine sums k contiguous rows.
        hidden = first.gated(hidden_states, offsets, pair_weights, rows=token_of_pair, zero_unwritten=span is not None)
        out = self.down_proj(hidden, offsets, out_rows=order, zero_unwritten=span is not None,
                             out_dtype=hidden_states.dtype)
        return _sum_slots(out.view(tokens, k, -1)).to(hidden_states.dtype)
    if isinstance(first, nn.Module):
        # FP8 experts (teacher_server/fp8_experts.py): the activation quantized once per token, each
        # pair's token row read by index in the product, no gathered copy.
        projected = first(hidden_states, offsets, rows=token_of_pair)
    else:
        x = hidden_states.index_select(0, token_of_pair).to(first.dtype)
        projected = _expert_product(self, first, x, offsets)
    if first_bias is not None:
        projected = projected + first_bias.index_select(0, sorted_experts)
    if isinstance(self.down_proj, nn.Module) and not (self.has_bias or post_norm):
        # FP8 experts write each product to its pair's row in token order: the combine is a sum over
        # each token's k contiguous rows. Under expert parallelism the other ranks' pairs are zeros.
        # A plain SwiGLU gate, the routing weight and the quantization run as one kernel.
        placed = dict(out_rows=order, zero_unwritten=span is not None, out_dtype=hidden_states.dtype)
        if getattr(self, "plain_swiglu", False):
            out = self.down_proj.swiglu_product(projected, pair_weights, offsets, **placed)
        else:
            hidden = (self._apply_gate(projected) if self.has_gate else self.act_fn(projected)) * pair_weights
            out = self.down_proj(hidden, offsets, **placed)
        return _sum_slots(out.view(tokens, k, -1)).to(hidden_states.dtype)
    hidden = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    # The routing weight applied before the down product (it is linear), where the rows are I wide
    # instead of H; a norm after each expert would not commute with it.
    if not post_norm:
        hidden = hidden * pair_weights
    fp8_down = isinstance(self.down_proj, nn.Module)  # FP8 experts take the activation in its dtype
    out = _expert_product(self, self.down_proj, hidden.to(hidden_states.dtype if fp8_down else self.down_proj.dtype),
                          offsets)
    if self.has_bias:
        bias = self.down_proj_bias.index_select(0, sorted_experts)
        out = out + (bias * pair_weights if not post_norm else bias)
    if post_norm:
        out = self.post_expert_norm(out) * pair_weights
    if local is not None:
        out = torch.where(local.unsqueeze(-1), out, 0)
    # One combine: each token's k rows back in token order, summed in float32.
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return _sum_slots(out.index_select(0, position).view(tokens, k, -1)).to(hidden_states.dtype)


def _sum_slots(rows: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> the float32 sum over k. Compiled, as k row additions: one elementwise kernel with
    k loads a token, each row read whole (the compiler's reduction over the middle dimension ran at
    0.85 TB/s on Qwen3-30B-A3B's [8192, 8, 2048]: 0.32 ms a layer, docs/performance.md). Eager, one
    reduction (k - 1 additions would be k - 1 kernels)."""
    if not torch.compiler.is_compiling():
        return rows.sum(dim=1, dtype=torch.float32)
    total = rows[:, 0].float()
    for slot in range(1, rows.shape[1]):
        total = total + rows[:, slot].float()
    return total


def _expert_product(self: nn.Module, weight, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`x`'s rows (sorted by expert) times their expert's matrix: [M, out]. An FP8 weight is a module
    that computes its own product (teacher_server/fp8_experts.py; [E, N, K] whatever the layout)."""
    if isinstance(weight, nn.Module):
        return weight(x, offsets)
    return grouped_mm(x, weight if self.is_transposed else weight.transpose(1, 2), offsets)


# ---- the expert load ------------------------------------------------------------------------

class ExpertLoad:
    """Tokens routed to each expert of each MoE layer: the last forward's and the running total
    since start-up (padding included: the engine pads rows, and padded tokens are routed too).
    Both stay on the device; `snapshot` copies them to the host (a reader's sync, not the engine's)."""

    def __init__(self, experts_per_layer: list[int], device: torch.device):
        self.experts_per_layer = experts_per_layer
        width = max(experts_per_layer)
        self.last = torch.zeros(len(experts_per_layer), width, dtype=torch.int32, device=device)
        self.total = torch.zeros(len(experts_per_layer), width, dtype=torch.int64, device=device)

    def accumulate(self) -> None:
        """After a forward: adds its counts to the total (one kernel, queued like the forward)."""
        self.total += self.last

    def reset(self) -> None:
        self.last.zero_()
        self.total.zero_()

    def snapshot(self) -> "ExpertLoadSnapshot":
        return ExpertLoadSnapshot([row[:e] for row, e in zip(self.last.tolist(), self.experts_per_layer)],
                                  [row[:e] for row, e in zip(self.total.tolist(), self.experts_per_layer)])


def imbalance(counts: list[int]) -> float:
    """The busiest expert's tokens over the mean per expert: 1 when routing is even, up to E / k
    when every token picks the same k experts; 0 before any token."""
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else 0.0


@dataclass(frozen=True)
class ExpertLoadSnapshot:
    last: list[list[int]]  # [layer][expert]: the last forward's tokens
    total: list[list[int]]  # [layer][expert]: tokens since start-up

    def status(self) -> dict:
        """/v1/status's part: per MoE layer, tokens per expert and their imbalance."""
        return {"layers": [{"layer": i, "imbalance_last": round(imbalance(last), 3),
                            "imbalance_total": round(imbalance(total), 3), "tokens_last": last, "tokens_total": total}
                           for i, (last, total) in enumerate(zip(self.last, self.total))]}


# ---- installing it ------------------------------------------------------------------------------

def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules that transformers' experts interface dispatches, in layer order."""
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and _expert_weight(getattr(m, "down_proj", None))]


def _expert_weight(weight) -> bool:
    """A 3-D parameter of transformers' experts, or its FP8 replacement (teacher_server/fp8_experts.py)."""
    return ((isinstance(weight, torch.Tensor) and weight.dim() == 3)
            or getattr(weight, "is_expert_weights", False))


def plain_swiglu(module: nn.Module) -> bool:
    """Whether the experts' gate is silu(gate) x up over the [gate | up] halves of the first
    product's output, nothing else (Qwen3-MoE, Mixtral, DeepSeek-V3; not gpt-oss's clamped,
    interleaved one): the gate FP8 experts fuse with their quantization."""
    if not getattr(module, "has_gate", False) or type(getattr(module, "act_fn", None)).__name__ not in (
            "SiLU", "SiLUActivation"):
        return False
    from transformers.integrations import moe as transformers_moe

    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is getattr(transformers_moe, "_default_apply_gate", None):
        return True
    try:  # a published FP8 checkpoint's experts class: the same gate when none of its limits is set
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return False
    limits = ("gate_softcap", "up_softcap", "swiglu_alpha", "limit", "swiglu_limit")
    return isinstance(module, FP8Experts) and all(getattr(module, name, None) is None for name in limits)


def global_experts(module: nn.Module) -> int:
    """How many experts the layer of `module` has, on all ranks together."""
    span = getattr(module, "expert_range", None)
    return span.total if span is not None else int(module.num_experts)


def install(model: nn.Module, group=None) -> ExpertLoad | None:
    """Runs the experts of `model`'s MoE layers through `experts_forward` and counts their load;
    None for a model without such layers (a dense one, or an MoE model whose experts class
    transformers' experts interface does not dispatch: it runs as transformers wrote it). `group`:
    the ranks of an expert-parallel model, which must route alike (routing.install; collective)."""
    modules = experts_modules(model)
    if not modules:
        return None
    from transformers.integrations.moe import ExpertsInterface

    problems = {type(m).__name__ for m in modules if getattr(m, "_is_expert_parallel", False)}
    if problems:
        raise MoeUnsupported(f"{', '.join(sorted(problems))}: experts sharded by transformers' expert parallelism, "
                             "which the teacher's experts forward does not read; the teacher shards MoE models with "
                             "its own plan (teacher_server/parallel.py: attention tensor parallel, experts expert "
                             "parallel): load the model without transformers' tp_plan")
    stored_fp8 = {type(m).__name__ for m in modules
                  if isinstance(m.down_proj, torch.Tensor) and m.down_proj.dtype in (FP8, torch.int8)}
    if stored_fp8:
        raise MoeUnsupported(f"{', '.join(sorted(stored_fp8))}: expert weights stored in FP8 (or FP4) without the "
                             "128 x 128 block scales the teacher serves (teacher_server/fp8_experts.py's "
                             "adopt_published reads those): dequantize the checkpoint (transformers' "
                             "FineGrainedFP8Config(dequantize=True), save_pretrained) and serve that directory, with "
                             "--quantize fp8 for FP8 experts")
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    try:  # a published FP8 checkpoint's experts class dispatches through transformers' FP8 interface
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        FP8ExpertsInterface = None
    if FP8ExpertsInterface is not None:
        FP8ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    unset = {type(m).__name__ for m in modules if getattr(m.config, "_experts_implementation", None) != IMPLEMENTATION}
    if unset:
        raise MoeUnsupported(f"transformers did not switch the experts of {', '.join(sorted(unset))} to "
                             f"{IMPLEMENTATION!r}: this transformers version dispatches them otherwise")
    for module in modules:
        module.plain_swiglu = plain_swiglu(module)  # read by the FP8 experts' path (a constant once compiled)
    device = modules[0].down_proj.device
    widths = [global_experts(m) for m in modules]
    load = ExpertLoad(widths, device)
    for layer, (module, width) in enumerate(zip(modules, widths)):
        # A buffer (not a plain attribute): a compiled layer takes it as an input, so one graph serves
        # every layer instead of one per layer's tensor. Not persistent: no checkpoint holds it.
        # Under expert parallelism every rank counts every expert (each sees the whole routing).
        module.register_buffer("expert_load_row", load.last[layer, :width], persistent=False)
    dtype = modules[0].down_proj.dtype
    if device.type == "cuda" and dtype not in (torch.bfloat16, FP8):
        log.warning("the experts are in %s on %s: torch's grouped GEMM runs bfloat16 there, so their products run "
                    "one expert at a time, with a host sync per layer; serve the model with --dtype bfloat16",
                    dtype, device)
    routed = routing.install(model, group)
    log.info("%d MoE layers of %s experts: routed through one grouped GEMM per product (%s)%s", len(modules),
             "/".join(sorted({str(e) for e in load.experts_per_layer})), IMPLEMENTATION,
             f"; {routed} routers' softmax and top-k in one op (teacher_server/routing.py)" if routed else "")
    return load


def use_eager(model: nn.Module) -> None:
    """transformers' one-expert-at-a-time forward and its routers' own (the tests' reference); the load
    is no longer counted."""
    model.set_experts_implementation(EAGER)
    routing.uninstall(model)
