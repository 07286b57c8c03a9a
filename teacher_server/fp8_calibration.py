"""What FP8 costs this teacher, measured on itself at start-up (--quantize fp8), and the linears
kept in the model's dtype so that the cost stays under a bound (--fp8-max-kl).

A toy's KL says little about a real teacher's: the same FP8 path costs 7.7e-4 nats per token
on a 12 x 768 Llama trained for 40 s and 3.3e-2 on SmolLM2-135M-Instruct (docs/performance.md).
So the teacher measures the one it serves, on a calibration batch (--fp8-calibration FILE of
text, or teacher_server/calibration_sample.py: English prose and Python source):

1. Reference: the model in its dtype over the batch: its log-probabilities (float32), and each
   decoder linear's mean input (for bias correction, FP8Linear.from_linear).
2. FP8: the linears quantized; the same batch: KL(model dtype || FP8) per token (mean, p99,
   max, float32 throughout) and top-1 agreement.
3. Under --fp8-max-kl, when the KL is above it: each linear's share of the KL, from one backward
   pass. With d_i a linear's output error (FP8 minus its own dtype, on the same input) and g_i
   the gradient of the summed KL with respect to its output, sum_i g_i . d_i = 2 KL to second
   order (near d = 0 the KL is d'Fd / 2, its gradient Fd), so g_i . d_i / 2 is linear i's
   share, the cross terms between linears' independent rounding errors averaging out. The
   linears of the largest share per FLOP go back to the model's dtype until the KL the shares
   predict is under the bound; the KL is measured again (step 2), and the prediction tightened
   until the measured KL holds.

What it costs: a reference forward, an FP8 forward, and under a bound that is not met a
forward and backward with both products, then an FP8 forward per round (SmolLM2-135M on 2 CPU
cores, 4 x 256 tokens: docs/performance.md). While it runs, the model's own linears are held
beside their FP8 copies (the decoder's weights twice).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from teacher_server import fp8

log = logging.getLogger(__name__)

# The largest --fp8-calibration file read (text: far more than any batch takes).
MAX_CALIBRATION_BYTES = 16 << 20
# The shares' prediction aims this far under the bound, and this much lower each round the
# measured KL is above it: the KL of a model in bf16 does not fall to 0 with the FP8 linears
# that are left (a perturbation anywhere costs a floor, docs/performance.md), so the
# prediction is optimistic near the bound.
_AIM = 0.8
_TIGHTEN = 0.6
MAX_ROUNDS = 6


class CalibrationError(ValueError):
    """The calibration cannot run as asked; the message names the flag to change."""


@dataclass(frozen=True)
class Cost:
    """What FP8 costs the teacher on its calibration batch."""

    kl_mean: float  # nats per token, KL(model dtype || FP8)
    kl_p99: float
    kl_max: float
    top1_agreement: float  # share of tokens whose most likely next token is the same
    tokens: int


def calibration_texts(path: str) -> tuple[str, ...]:
    """--fp8-calibration's text (UTF-8, at most MAX_CALIBRATION_BYTES), or the built-in sample."""
    if not path:
        from teacher_server.calibration_sample import TEXTS

        return TEXTS
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CALIBRATION_BYTES + 1)
    except OSError as e:
        raise CalibrationError(f"--fp8-calibration {path}: cannot read it: {e.strerror or e}") from e
    if len(data) > MAX_CALIBRATION_BYTES:
        raise CalibrationError(f"--fp8-calibration {path} is larger than {MAX_CALIBRATION_BYTES >> 20} MiB: give "
                               "a sample of the text the teacher serves (a few thousand tokens are enough)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CalibrationError(f"--fp8-calibration {path}: not UTF-8 text (byte {e.start}): give a text file") from e
    return (text,)


def calibration_batch(tokenizer, texts: tuple[str, ...], rows: int, seq: int, vocab_size: int) -> torch.Tensor:
    """[rows, seq] token ids: consecutive windows of `seq` tokens of each text in turn (so a
    batch of prose and source holds both). Without a tokenizer (builtin: and random: models),
    the texts' UTF-8 bytes modulo the vocabulary stand for tokens."""
    windows = []
    for text in texts:
        ids = (tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None
               else [b % vocab_size for b in text.encode("utf-8")])
        windows.append([ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)])
    picked = []
    for round_ in range(max((len(w) for w in windows), default=0)):
        picked += [w[round_] for w in windows if round_ < len(w)]
    if len(picked) < rows:
        raise CalibrationError(f"the FP8 calibration text gives {len(picked)} windows of {seq} tokens, and "
                               f"--fp8-calibration-rows asks for {rows}: give a longer --fp8-calibration file or "
                               "fewer rows (or a shorter --fp8-calibration-seq)")
    return torch.tensor(picked[:rows], dtype=torch.long)


def kl_cost(reference: torch.Tensor, other: torch.Tensor) -> tuple[Cost, torch.Tensor]:
    """Per-token KL(reference || other) of two [..., V] float32 log-probability tensors, and its summary."""
    kl = (reference.exp() * (reference - other)).sum(-1).flatten()
    top1 = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    return Cost(kl.mean().item(), kl.quantile(0.99).item() if kl.numel() <= 1 << 24 else math.nan,
                kl.max().item(), top1, kl.numel()), kl


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)


@dataclass
class Calibrated:
    """What the calibration chose and measured."""

    cost: Cost
    plan: fp8.Fp8Plan  # the plan as served: its keep_linears what the bound needed
    fp8_flop_share: float  # the decoder linears' multiply-adds that run in FP8
    seconds: float
    rounds: int  # FP8 measurements after the first (0: the bound held with every linear in FP8)


def quantize_and_measure(model, plan: fp8.Fp8Plan, ids: torch.Tensor,
                         also: Callable[[nn.Module], None] | None = None) -> Calibrated:
    """Quantizes `model`'s decoder linears to FP8 in place as `plan` says, measured on `ids`
    against the model in its dtype; under `plan.max_kl`, keeps the costliest linears in the
    model's dtype until the measured KL is at most the bound. `also`: what else is quantized
    with them (a MoE model's experts), after the reference forward and before the measurement;
    never kept. Raises CalibrationError when the bound cannot be met."""
    started = time.perf_counter()
    model.eval().requires_grad_(False)  # the shares' backward pass wants no weight gradients
    ids = ids.to(next(model.parameters()).device)
    linears = fp8.decoder_linears(model)
    originals = {name: entry[3] for name, entry in linears.items()}
    means: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        reference = record_means(model, ids, originals, means) if plan.bias_correction else log_probs(model, ids)
    fp8.quantize_model(model, plan, means if plan.bias_correction else None)
    if also is not None:
        also(model)
    quantized = {name: entry[3] for name, entry in fp8.decoder_linears(model).items()
                 if isinstance(entry[3], fp8.FP8Linear)}
    with torch.inference_mode():
        cost, _ = kl_cost(reference, log_probs(model, ids))
    log.info("FP8 calibration on %d tokens: KL %.3g per token (p99 %.3g), top-1 agreement %.2f%% with every planned "
             "linear in FP8", cost.tokens, cost.kl_mean, cost.kl_p99, 100 * cost.top1_agreement)
    rounds, kept = 0, set(plan.keep_linears)
    if plan.max_kl and cost.kl_mean > plan.max_kl:
        shares = kl_shares(model, ids, reference, linears, originals, quantized)
        flops = {name: fp8.linear_flops(module) for name, module in quantized.items()}
        # Most KL per multiply-add first: the FP8 share kept largest for the KL given back.
        order = sorted(quantized, key=lambda name: -max(shares[name], 0.0) / flops[name])
        aim = plan.max_kl * _AIM
        total = cost.kl_mean
        while cost.kl_mean > plan.max_kl:
            rounds += 1
            if rounds > MAX_ROUNDS:
                raise CalibrationError(
                    f"--fp8-max-kl {plan.max_kl:g}: after {MAX_ROUNDS} rounds the KL on the calibration batch is still "
                    f"{cost.kl_mean:.3g} with {fp8_flop_share(model):.0%} of the decoder's linear FLOPs in FP8: raise "
                    "the bound, or serve without --quantize fp8")
            chosen, predicted = set(), total
            for name in order:
                if predicted <= aim:
                    break
                chosen.add(name)
                predicted -= max(shares[name], 0.0)
            if predicted > aim:
                chosen = set(order)  # the shares do not reach the aim: every linear back
            for name in chosen - kept:
                index, parent, attr, _ = linears[name]
                setattr(parent, attr, originals[name])
            kept |= chosen
            with torch.inference_mode():
                cost, _ = kl_cost(reference, log_probs(model, ids))
            log.info("FP8 calibration round %d: %d linears kept in the model's dtype (%.0f%% of the linear FLOPs in "
                     "FP8): KL %.3g per token", rounds, len(kept), 100 * fp8_flop_share(model), cost.kl_mean)
            aim *= _TIGHTEN
    plan = dataclasses.replace(plan, keep_linears=tuple(name for name in linears if name in kept))
    return Calibrated(cost, plan, fp8_flop_share(model), time.perf_counter() - started, rounds)


def fp8_flop_share(model) -> float:
    """The share of the decoder linears' multiply-adds per token that run in FP8."""
    linears = [entry[3] for entry in fp8.decoder_linears(model).values()]
    return sum(fp8.linear_flops(m) for m in linears if isinstance(m, fp8.FP8Linear)) / sum(map(fp8.linear_flops,
                                                                                              linears))


def record_means(model, ids: torch.Tensor, linears: dict[str, nn.Module], means: dict) -> torch.Tensor:
    """The reference forward, recording each linear's mean input (float32) into `means`."""
    hooks = []
    for name, module in linears.items():
        def hook(_module, args, name=name):
            x = args[0].reshape(-1, args[0].shape[-1])
            means[name] = x.float().mean(0)
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        return log_probs(model, ids)
    finally:
        for h in hooks:
            h.remove()


class _Attributed(nn.Module):
    """The FP8 linear's output, with gradients through its original: out = y + (y_fp8 - y),
    the difference held, so the backward pass gives d(KL)/d(out) at the FP8 model's point."""

    def __init__(self, quantized: fp8.FP8Linear, original: nn.Module):
        super().__init__()
        self.quantized, self.original = quantized, original
        self.share = 0.0

    def forward(self, x):
        exact = self.original(x)
        with torch.no_grad():
            error = (self.quantized(x) - exact).float()
        out = exact + error.to(x.dtype)
        if out.requires_grad:
            out.register_hook(lambda grad: self._take(grad, error))
        return out

    def _take(self, grad: torch.Tensor, error: torch.Tensor) -> None:
        self.share = (grad.float() * error).sum().item() / 2


def kl_shares(model, ids, reference, linears, originals, quantized) -> dict[str, float]:
    """Each FP8 linear's share of the summed KL over the batch, per token (see the module's
    docstring); they add up to the measured mean KL, to second order."""
    reference = reference.clone()  # out of inference mode: the backward pass saves it
    wrapped = {}
    for name, module in quantized.items():
        index, parent, attr, _ = linears[name]
        wrapped[name] = _Attributed(module, originals[name])
        setattr(parent, attr, wrapped[name])
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds, use_cache=False).logits.float().log_softmax(-1)
            kl = (reference.exp() * (reference - logits)).sum()
            kl.backward()
    finally:
        for name, module in quantized.items():
            index, parent, attr, _ = linears[name]
            setattr(parent, attr, module)
    tokens = ids.numel()
    return {name: w.share / tokens for name, w in wrapped.items()}
