"""The MoE router's softmax and top-k in one kernel on a GPU (`softmax_topk`, a custom op), for the
routers that are a linear, a softmax over the experts and a top-k (Qwen2-MoE, Qwen3-MoE, OLMoE,
Mixtral; `install` replaces their forward, checked against the model's own first).

    probs = softmax(logits, float32)     values, experts = top-k of probs     (then normalised, cast)

In a compiled decoder layer inductor writes the softmax as a kernel of its own and calls torch's
top-k as it is, which took 0.062 ms a layer on Qwen3-30B-A3B's [8192 x 128] logits on an H200
(3.0 ms of a 100-ms forward, bf16 and FP8 alike; docs/performance.md). This kernel reads a few
rows of logits a program, in registers: the row's maximum, the sum of exp(x - max), then k rounds
of choosing the largest logit not yet chosen (the lowest index among equal ones) and its
probability exp(x - max) / sum.

It chooses by the logits, which softmax orders as the probabilities (it is monotonic), and breaks
ties by index; torch's top-k breaks ties among equal probabilities its own way (on a CPU not by
index), and bf16 logits tie often (at the k-th place in 6% of the rows of random [*, 128] bf16
logits): such a row gets experts of the same probabilities, possibly not the same ones. Distinct
logits whose probabilities round to the same float32 (logits within about 1e-5 of each other and
of 0) are ordered by the logits here. A row whose softmax is NaN (a NaN or an infinite logit)
gets experts 0 .. k-1 with NaN weights, so its outputs are NaN as the model's would be.

On a CPU, or without Triton, the op is the model's own arithmetic (softmax, then torch.topk).
`install` checks each replaced router against its own forward on its device (the chosen experts'
probabilities as a multiset per row, and the weights) and keeps the model's forward where they
differ, saying so; tests/test_routing.py holds the kernel to torch under Triton's interpreter,
tests/gpu/test_moe_gpu.py on the GPU.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: `softmax_topk` is torch's arithmetic
    triton = None

log = logging.getLogger(__name__)

# The widest router the kernel holds in registers (a row of logits); wider ones run torch's.
KERNEL_MAX_EXPERTS = 1024
# Router classes whose forward is F.linear(x, weight) -> softmax (float32) -> top-k, then the top
# weights divided by their sum ("always", or "flag": when `norm_topk_prob`) and cast back to the
# logits' dtype (True) or left float32 (False).
ROUTERS = {
    "Qwen2MoeTopKRouter": ("flag", True),
    "Qwen3MoeTopKRouter": ("flag", True),
    "OlmoeTopKRouter": ("flag", True),
    "MixtralTopKRouter": ("always", False),
}


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' own arithmetic: (float32 top-k probabilities, int64 experts), [T, k] each."""
    return torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), k, dim=-1)


def kernel_serves(device: torch.device, experts: int, k: int) -> bool:
    """Whether `softmax_topk` runs the Triton kernel for `experts`-wide logits on `device`."""
    return triton is not None and device.type == "cuda" and 0 < k <= experts <= KERNEL_MAX_EXPERTS


if triton is not None:
    @triton.jit
    def _softmax_topk_kernel(logits_ptr, values_ptr, experts_ptr, T, E, stride_t, K: tl.constexpr,
                             BLOCK_E: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        x = tl.load(logits_ptr + rows64[:, None] * stride_t + cols[None, :],
                    mask=row_ok[:, None] & (cols < E)[None, :], other=float("-inf")).to(tl.float32)
        top = tl.max(x, 1)
        e = tl.exp(x - top[:, None])  # 0 for the columns past E
        total = tl.sum(e, 1)
        bad = total != total  # a NaN sum: a NaN or an infinite logit (the softmax is NaN)
        taken = (cols >= E)[None, :] & (rows >= 0)[:, None]  # [ROWS, BLOCK_E]
        for i in tl.static_range(K):
            best = tl.max(tl.where(taken, float("-inf"), x), 1)
            expert = tl.min(tl.where((x == best[:, None]) & ~taken, cols[None, :], BLOCK_E), 1)
            expert = tl.where(bad | (expert >= E), i, expert)
            chosen = cols[None, :] == expert[:, None]
            taken = taken | chosen
            value = tl.sum(tl.where(chosen, e, 0.0), 1) / total
            tl.store(values_ptr + rows64 * K + i, value, mask=row_ok)
            tl.store(experts_ptr + rows64 * K + i, expert.to(tl.int64), mask=row_ok)


def launch(logits: torch.Tensor, k: int, values: torch.Tensor, experts: torch.Tensor) -> None:
    """The kernel on logits [T, E] (unit column stride) into values float32 [T, k] and experts int64 [T, k]."""
    t, e = logits.shape
    width = max(triton.next_power_of_2(e), 16)
    rows = max(1, min(16, 2048 // width))
    if t:
        _softmax_topk_kernel[(triton.cdiv(t, rows),)](logits, values, experts, t, e, logits.stride(0), K=k,
                                                       BLOCK_E=width, ROWS=rows, num_warps=4)


@torch.library.custom_op("distill_moe::softmax_topk", mutates_args=())
def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (the top-k probabilities of softmax(logits) in float32, their experts int64),
    [T, k] each, the largest first."""
    if logits.dim() != 2 or not kernel_serves(logits.device, logits.shape[1], k):
        values, experts = reference(logits, k)
        return values.contiguous(), experts.contiguous()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    values = torch.empty(logits.shape[0], k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(logits.shape[0], k, dtype=torch.int64, device=logits.device)
    launch(logits, k, values, experts)
    return values, experts


@softmax_topk.register_fake
def _(logits, k):
    return (logits.new_empty((logits.shape[0], k), dtype=torch.float32),
            logits.new_empty((logits.shape[0], k), dtype=torch.int64))


def _forward(self, hidden_states: torch.Tensor):
    """A softmax-then-top-k router's forward (ROUTERS) through `softmax_topk`."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    values, experts = softmax_topk(router_logits, self.top_k)
    if self.routing_normalizes:
        values = values / values.sum(dim=-1, keepdim=True)
    if self.routing_casts:
        values = values.to(router_logits.dtype)
    return router_logits, values, experts


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers of a class in ROUTERS, with the attributes their forward reads."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS and isinstance(getattr(m, "weight", None),
                                                                                 torch.Tensor)
            and all(hasattr(m, a) for a in ("top_k", "hidden_dim")) and getattr(m, "bias", None) is None]


def install(model: torch.nn.Module) -> int:
    """Runs the model's softmax-then-top-k routers through `softmax_topk`; returns how many. On a
    GPU each kind of router (class, width, k, dtype) is checked against its own forward first
    (`check`); one that differs, or whose kernel fails, keeps its forward, with a warning."""
    replaced, checked = 0, {}
    for module in routers(model):
        normalizes, casts = ROUTERS[type(module).__name__]
        module.routing_normalizes = normalizes == "always" or bool(getattr(module, "norm_topk_prob", False))
        module.routing_casts = casts
        fast = types.MethodType(_forward, module)
        key = (type(module).__name__, tuple(module.weight.shape), module.top_k, module.routing_normalizes,
               module.weight.dtype, module.weight.device)
        if key not in checked:
            served = kernel_serves(module.weight.device, module.weight.shape[0], module.top_k)
            try:
                checked[key] = check(module, fast) if served else ""
            except Exception as e:  # a kernel that does not build or run here: the model's own router serves
                checked[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if checked[key]:
                log.warning("%s (%d experts, top-%d): the router's softmax-and-top-k kernel differs from its own "
                            "forward (%s); these routers keep their forward", key[0], key[1][0], module.top_k,
                            checked[key])
        if not checked[key]:
            module.forward = fast
            replaced += 1
    return replaced


def uninstall(model: torch.nn.Module) -> None:
    """The routers' own forward again (the tests' eager reference)."""
    for module in routers(model):
        module.__dict__.pop("forward", None)


@torch.no_grad()
def check(module: torch.nn.Module, fast, rows: int = 1024) -> str:
    """What differs between `fast` and the router's own forward on random rows on its device ("" when
    nothing does): the logits, the chosen experts' probabilities (per row, as a multiset: a tie
    broken otherwise chooses experts of equal probability), the weights."""
    generator = torch.Generator(device=module.weight.device).manual_seed(0)
    x = torch.randn(rows, module.hidden_dim, device=module.weight.device, dtype=module.weight.dtype,
                    generator=generator)
    logits, values, experts = type(module).forward(module, x)
    got_logits, got_values, got_experts = fast(x)
    if not torch.equal(got_logits, logits):
        return "the logits differ"
    if got_experts.shape != experts.shape or not bool(((got_experts >= 0) & (got_experts < logits.shape[1])).all()):
        return f"experts of shape {tuple(got_experts.shape)} or out of range"
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    chosen = probs.gather(1, got_experts).sort(dim=-1, descending=True).values
    wanted = probs.gather(1, experts).sort(dim=-1, descending=True).values
    if not torch.equal(chosen, wanted):
        return f"other experts chosen in {int((chosen != wanted).any(dim=-1).sum())} of {rows} rows"
    # The weights, largest first in both (a tie broken otherwise puts an equal weight elsewhere).
    if got_values.dtype != values.dtype:
        return f"weights in {got_values.dtype}, not {values.dtype}"
    got_sorted = got_values.float().sort(dim=-1, descending=True).values
    want_sorted = values.float().sort(dim=-1, descending=True).values
    tolerance = 1e-5 if values.dtype == torch.float32 else 2 ** -7
    if not torch.allclose(got_sorted, want_sorted, rtol=tolerance, atol=1e-7):
        return f"the weights differ by up to {(got_sorted - want_sorted).abs().max().item():.3g}"
    return ""
