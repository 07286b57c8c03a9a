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
logits whose probabilities round to the same float32 (about 1e-8 apart and below) are ordered by
the logits here. A row whose softmax is NaN (a NaN or +inf logit, or every logit -inf) gets
experts 0 .. k-1 with NaN weights, so its outputs are NaN as the model's would be.

On a CPU, or without Triton, the op is the model's own arithmetic (softmax, then torch.topk).
`install` checks each kind of router on its device first: the op against `expected` on logits that
random rows rarely give (ties, NaN and infinite logits), then the replaced forward against the
router's own on random rows (the logits; no expert twice; the chosen experts' probabilities as a
multiset per row; each weight its own expert's, normalised and cast as the router does) and keeps
the model's forward where they differ or the kernel fails, saying so; the ranks of an
expert-parallel model take it only together. tests/test_routing.py holds the kernel to a stable
sort of the logits under Triton's interpreter, tests/gpu/test_moe_gpu.py on the GPU. (A model with
the kernel installed does not pickle whole: its routers' forward is a bound method.)
"""

from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: `softmax_topk` is torch's arithmetic
    triton = None

log = logging.getLogger(__name__)

IMPLEMENTATION = "softmax_topk"  # what /v1/status's kernels name

# The widest router the kernel holds in registers (a row of logits), and the most experts a token it
# routes (its k rounds are unrolled: compiling k = 64 took 30 s); others run torch's.
KERNEL_MAX_EXPERTS = 1024
KERNEL_MAX_K = 32
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
    return (triton is not None and device.type == "cuda" and 0 < k <= min(experts, KERNEL_MAX_K)
            and experts <= KERNEL_MAX_EXPERTS)


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
        bad = total != total  # a NaN sum: a NaN or +inf logit, or all -inf (the softmax is NaN)
        taken = (cols >= E)[None, :] & (rows >= 0)[:, None]  # [ROWS, BLOCK_E]
        for i in tl.static_range(K):
            best = tl.max(tl.where(taken, float("-inf"), x), 1)
            expert = tl.min(tl.where((x == best[:, None]) & ~taken, cols[None, :], BLOCK_E), 1)
            # (none equal to the maximum can only be a NaN row; else the lowest column not chosen)
            expert = tl.where(expert >= BLOCK_E, tl.min(tl.where(taken, BLOCK_E, cols[None, :]), 1), expert)
            expert = tl.where(bad, i, expert)
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


def install(model: torch.nn.Module, group=None) -> int:
    """Runs the model's softmax-then-top-k routers through `softmax_topk`; returns how many. On a
    GPU each kind of router (class, width, k, dtype) is checked against its own forward first
    (`check`); one that differs, or whose kernel fails, keeps its forward, with a warning. With
    `group` (the ranks of an expert-parallel model, which each route every token and must route
    alike), a kind of router takes the kernel only where it passed on every rank (collective)."""
    found = routers(model)
    verdicts: dict[tuple, str] = {}
    for module in found:
        normalizes, casts = ROUTERS[type(module).__name__]
        module.routing_normalizes = normalizes == "always" or bool(getattr(module, "norm_topk_prob", False))
        module.routing_casts = casts
        key, weight = _kind(module), module.weight
        if key in verdicts:
            continue
        if not kernel_serves(weight.device, weight.shape[0], module.top_k):
            verdicts[key] = ""  # torch's arithmetic: the router's own
            continue
        try:
            verdicts[key] = (check_kernel(weight.device, weight.shape[0], module.top_k, weight.dtype)
                             or check(module, types.MethodType(_forward, module)))
        except Exception as e:  # a kernel that does not build or run here: the model's own router serves
            verdicts[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if group is not None and verdicts:
        passed = torch.tensor([not why for why in verdicts.values()], dtype=torch.int32,
                              device=found[0].weight.device)
        dist.all_reduce(passed, op=dist.ReduceOp.MIN, group=group)
        for key, ok in zip(list(verdicts), passed.tolist()):
            if not ok and not verdicts[key]:
                verdicts[key] = "it failed on another rank"
    for key, why in verdicts.items():
        if why:
            log.warning("%s (%d experts, top-%d): the router's softmax-and-top-k kernel differs from its own "
                        "forward (%s); these routers keep their forward", key[0].__name__, key[1][0], key[2], why)
    replaced = 0
    for module in found:
        if not verdicts[_kind(module)]:
            module.forward = types.MethodType(_forward, module)
            replaced += 1
    return replaced


def _kind(module: torch.nn.Module) -> tuple:
    """What one check covers: routers alike in class, width, k, normalisation, dtype and device."""
    return (type(module), tuple(module.weight.shape), module.top_k, module.routing_normalizes, module.weight.dtype,
            module.weight.device)


def served(model: torch.nn.Module) -> int:
    """How many of the model's routers run the kernel (replaced, on a device the kernel serves)."""
    return sum(getattr(m.__dict__.get("forward"), "__func__", None) is _forward
               and kernel_serves(m.weight.device, m.weight.shape[0], m.top_k) for m in routers(model))


def uninstall(model: torch.nn.Module) -> None:
    """The routers' own forward again (the tests' eager reference)."""
    for module in routers(model):
        if getattr(module.__dict__.get("forward"), "__func__", None) is _forward:
            del module.forward


def expected(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel gives, written with torch's operators: the first k of a stable descending sort
    of the logits (ties by index) and softmax's probabilities there; experts 0 .. k-1 and NaN for a
    row whose softmax is NaN."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    experts = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    bad = probs.isnan().any(dim=-1, keepdim=True)
    experts = torch.where(bad, torch.arange(k, device=logits.device), experts)
    return probs.gather(1, experts), experts


@torch.no_grad()
def check(module: torch.nn.Module, fast) -> str:
    """What differs between `fast` and the router's own forward on random rows on its device ("" when
    nothing does; 1, 1021 and 1024 rows: a partial last program, Triton's specialisations)."""
    generator = torch.Generator(device=module.weight.device).manual_seed(0)
    for rows in (1, 1021, 1024):
        x = torch.randn(rows, module.hidden_dim, device=module.weight.device, dtype=module.weight.dtype,
                        generator=generator)
        why = _compare(module, type(module).forward(module, x), fast(x))
        if why:
            return f"{why} ({rows} rows)"
    return ""


@torch.no_grad()
def check_kernel(device: torch.device, width: int, k: int, dtype: torch.dtype) -> str:
    """What differs between `softmax_topk` and `expected` on logits that random rows rarely give
    ("" when nothing does): ties in most rows, a NaN, a +inf and an all -inf row, -inf columns."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randint(-3, 4, (37, width), device=device, generator=generator) / 4).to(dtype)
    logits[1, 0], logits[2, -1], logits[3] = float("nan"), float("inf"), float("-inf")
    logits[4, : width // 2] = float("-inf")
    values, experts = softmax_topk(logits, k)
    want_values, want_experts = expected(logits, k)
    if not torch.equal(experts, want_experts):
        return f"other experts than the stable sort of the logits in {_rows(experts != want_experts)} of 37 rows"
    if not torch.allclose(values, want_values, rtol=1e-5, atol=1e-30, equal_nan=True):
        return "weights other than softmax's probabilities"
    return ""


def _rows(mismatch: torch.Tensor) -> int:
    return int(mismatch.any(dim=-1).sum())


def _compare(module, own, got) -> str:
    logits, values, experts = own
    got_logits, got_values, got_experts = got
    if not torch.equal(got_logits, logits):
        return "the logits differ"
    if got_experts.shape != experts.shape or not bool(((got_experts >= 0) & (got_experts < logits.shape[1])).all()):
        return f"experts of shape {tuple(got_experts.shape)} or out of range"
    ordered = got_experts.sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        return f"an expert chosen twice in {_rows(ordered[:, 1:] == ordered[:, :-1])} rows"
    # The chosen experts' probabilities as a multiset per row: a tie broken otherwise chooses experts
    # of equal probability.
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    chosen = probs.gather(1, got_experts)
    chosen_set, wanted_set = chosen.sort(dim=-1).values, probs.gather(1, experts).sort(dim=-1).values
    if not torch.equal(chosen_set, wanted_set):
        return f"other experts chosen in {_rows(chosen_set != wanted_set)} rows"
    # Each weight that of its own expert: its probability, normalised and cast as the router does.
    if got_values.dtype != values.dtype:
        return f"weights in {got_values.dtype}, not {values.dtype}"
    weights = chosen / chosen.sum(dim=-1, keepdim=True) if module.routing_normalizes else chosen
    weights = weights.to(values.dtype)
    tolerance = 1e-5 if values.dtype == torch.float32 else 2 ** -7
    if not torch.allclose(got_values.float(), weights.float(), rtol=tolerance, atol=1e-7):
        return f"the weights differ by up to {(got_values.float() - weights.float()).abs().max().item():.3g}"
    # and, in the router's own order, its weights (a multiset again).
    if not torch.allclose(got_values.float().sort(dim=-1).values, values.float().sort(dim=-1).values,
                          rtol=tolerance, atol=1e-7):
        return "the weights differ from the router's own"
    return ""
