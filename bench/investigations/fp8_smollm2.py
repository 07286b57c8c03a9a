"""Where FP8's error comes from on a real teacher, and what each fix buys: SmolLM2-135M-Instruct
(distill_common/smollm2.py builds it), in bf16 on the CPU, through the project's FP8 path
(teacher_server/fp8.py: torch's CPU `_scaled_mm`, row scales) unless a section says otherwise.

    python -m bench.investigations.fp8_smollm2 --sections floor,wa,outliers,types,layers,methods

Text: --rows sequences of --seq tokens, half English prose (the language reference's prose,
Python's own pydoc_data.topics) and half Python source (standard-library modules; both as
bench/fp8_teacher.py's smollm2 section takes them), none of it
the start-up calibration's built-in sample (teacher_server/calibration_sample.py), which the
calibrated plans are chosen on. KL(bf16 || X) per token in nats, float32 log-softmax.

Sections:
  floor     bf16 against float32 (the model's own rounding)
  wa        weight against activation quantization, simulated (dequantize, multiply in float32):
            e4m3 weights per output channel or per 1 x 128 group, activations per token or per
            1 x 128 group (zero-padded to a multiple of 128), bias correction
  outliers  each linear input's per-token amax / RMS, its largest channel against the median
            channel, and the share of values under e4m3's smallest normal once scaled
  types     one kind of linear (q, k, v, o, gate, up, down) in FP8 in every layer, the rest bf16
  layers    one decoder layer's seven linears in FP8, the rest bf16
  linears   one linear in FP8, the rest bf16 (210 forwards from the cached input of its layer)
  shares    the start-up calibration's gradient shares (teacher_server/fp8_calibration.py), summed
            per kind and per layer, beside the measured `types` and `layers`
  methods   KL against the share of the decoder's linear FLOPs in FP8, for each method
  curve     each method at fixed FP8 shares (--targets), the same linears kept in bf16 for all:
            those of the largest gradient share per FLOP on the calibration batch
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from bench.fp8_teacher import smollm2_eval_batch
from bench.table import emit
from teacher_server import fp8
from teacher_server import fp8_calibration as calibration

def load(dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill_common.smollm2 import model_dir

    path = model_dir()
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)


def fake_rows(x: torch.Tensor) -> torch.Tensor:
    return fp8.dequantize(*fp8.quantize_rows(x))


def fake_groups(x: torch.Tensor) -> torch.Tensor:
    """1 x 128 groups along the last dimension, zero-padded to a multiple of 128."""
    k = x.shape[-1]
    padded = nn.functional.pad(x.float(), (0, (-k) % fp8.BLOCK))
    return fp8.dequantize(*fp8.quantize_row_blocks(padded))[:, :k]


class Simulated(nn.Module):
    """A linear with its weight and input rounded to e4m3 as asked, multiplied in float32:
    weights "none" / "row" / "group"; activations "none" / "row" / "group"; `smooth` [K]
    SmoothQuant factors (x / s, W * s); `mean` [K]: bias correction."""

    def __init__(self, linear: nn.Linear, weights: str, acts: str, mean: torch.Tensor | None = None,
                 smooth: torch.Tensor | None = None):
        super().__init__()
        w = linear.weight.detach().float()
        self.smooth = smooth
        if smooth is not None:
            w = w * smooth
        self.w = {"none": lambda t: t, "row": fake_rows, "group": fake_groups}[weights](w)
        self.acts = acts
        self.bias = None if mean is None else (mean.float() / (smooth if smooth is not None else 1)) @ (w - self.w).t()

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.smooth is not None:
            x2 = x2 / self.smooth
        x2 = {"none": lambda t: t, "row": fake_rows, "group": fake_groups}[self.acts](x2)
        y = x2 @ self.w.t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class Bench:
    def __init__(self, args):
        self.args = args
        self.tokenizer, self.model = load()
        self.ids = smollm2_eval_batch(self.tokenizer, args.rows, args.seq)
        self.calib = calibration.calibration_batch(self.tokenizer, calibration.calibration_texts(""),
                                                   args.calibration_rows, args.seq, self.model.config.vocab_size)
        self.linears = fp8.decoder_linears(self.model)
        self.originals = {name: e[3] for name, e in self.linears.items()}
        self.reference = log_probs(self.model, self.ids)
        self.means = {}
        with torch.inference_mode():
            calibration.record_means(self.model, self.calib, self.originals, self.means)
        self.flops = {name: fp8.linear_flops(m) for name, m in self.originals.items()}

    def set(self, modules: dict[str, nn.Module]) -> None:
        """`modules` in place of the named linears; every other linear its bf16 original."""
        for name, (_, parent, attr, _) in self.linears.items():
            setattr(parent, attr, modules.get(name, self.originals[name]))

    def fp8(self, names, mean: bool = False) -> dict[str, nn.Module]:
        return {n: fp8.FP8Linear.from_linear(self.originals[n], "row", input_mean=self.means[n] if mean else None)
                for n in names}

    def cost(self, model=None) -> calibration.Cost:
        return calibration.kl_cost(self.reference, log_probs(model or self.model, self.ids))[0]

    def share(self, names) -> float:
        return sum(self.flops[n] for n in names) / sum(self.flops.values())


def row(cost: calibration.Cost, *first) -> str:
    return "| " + " | ".join(map(str, first)) + (f" | {cost.kl_mean:.2e} | {cost.kl_p99:.2e} | {cost.kl_max:.2e} | "
                                                 f"{cost.top1_agreement:.1%} |")


def floor(b: Bench, lines: list, figures: dict) -> None:
    model32 = copy.deepcopy(b.model).float()
    cost = b.cost(model32)
    figures["floor"] = cost.__dict__
    lines += ["| model vs bf16 | KL mean | KL p99 | KL max | top-1 |", "|---|---|---|---|---|", row(cost, "float32")]


def weights_and_acts(b: Bench, lines: list, figures: dict) -> None:
    lines += ["", "| weights | activations | bias correction | KL mean | KL p99 | KL max | top-1 |",
              "|---|---|---|---|---|---|---|"]
    for weights, acts, corrected in [("none", "none", False), ("row", "none", False), ("group", "none", False),
                                     ("row", "none", True), ("none", "row", False), ("none", "group", False),
                                     ("row", "row", False), ("row", "row", True), ("row", "group", True),
                                     ("group", "group", True)]:
        b.set({n: Simulated(m, weights, acts, b.means[n] if corrected else None) for n, m in b.originals.items()})
        cost = b.cost()
        figures[f"wa/{weights}/{acts}/{corrected}"] = cost.__dict__
        lines.append(row(cost, weights, acts, "yes" if corrected else "no"))
        print(lines[-1], flush=True)
    b.set({})


def outliers(b: Bench, lines: list, figures: dict) -> None:
    stats: dict[str, list] = {}

    def hook(name):
        def record(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            amax = x.abs().amax(-1)
            channel = x.abs().amax(0)
            under = (x.abs() < amax[:, None] / fp8.FP8_MAX * 2.0 ** -6).float().mean().item()
            stats[name] = [(amax / x.pow(2).mean(-1).sqrt()).median().item(), (channel / channel.median()).max().item(),
                           under, x.abs().max().item()]
        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in b.originals.items()]
    log_probs(b.model, b.ids)
    for h in hooks:
        h.remove()
    figures["outliers"] = stats
    lines += ["", "| linear input | amax / RMS per token (median over layers) | largest channel / median channel "
              "(max over layers, layer) | values under e4m3's smallest normal, row scales (max over layers) | "
              "largest |x| |", "|---|---|---|---|---|"]
    for kind in fp8.LINEAR_NAMES:
        rows = {n: s for n, s in stats.items() if n.endswith(kind)}
        worst = max(rows, key=lambda n: rows[n][1])
        lines.append(f"| {kind} | {sorted(s[0] for s in rows.values())[len(rows) // 2]:.1f} | {rows[worst][1]:.3g} "
                     f"({b.linears[worst][0]}) | {max(s[2] for s in rows.values()):.2%} | "
                     f"{max(s[3] for s in rows.values()):.3g} |")


def types_and_layers(b: Bench, lines: list, figures: dict, which: str) -> None:
    groups = ({kind: [n for n in b.originals if n.endswith(kind)] for kind in fp8.LINEAR_NAMES} if which == "types"
              else {str(i): [n for n, e in b.linears.items() if e[0] == i] for i in range(len(fp8.decoder_layers(
                  b.model)))})
    lines += ["", f"| {which[:-1]} in FP8 | FLOP share | KL mean | KL p99 | KL max | top-1 |",
              "|---|---|---|---|---|---|"]
    for key, names in groups.items():
        b.set(b.fp8(names))
        cost = b.cost()
        figures[f"{which}/{key}"] = cost.__dict__
        lines.append(row(cost, key, f"{b.share(names):.1%}"))
        print(lines[-1], flush=True)
    b.set({})


def per_linear(b: Bench, lines: list, figures: dict) -> None:
    """Each linear alone in FP8, the forward resumed from its layer's cached input."""
    layers = fp8.decoder_layers(b.model)
    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda _m, args, kwargs, i=i: inputs.__setitem__(i, (args, kwargs)),
                                             with_kwargs=True) for i, layer in enumerate(layers)]
    log_probs(b.model, b.ids)
    for h in hooks:
        h.remove()

    @torch.inference_mode()
    def from_layer(i):
        args, kwargs = inputs[i]
        hidden = args[0]
        for layer in layers[i:]:
            hidden = layer(hidden, **kwargs)
        return b.model.lm_head(b.model.model.norm(hidden)).float().log_softmax(-1)

    started = time.perf_counter()
    costs = {}
    for name, (index, _, _, _) in b.linears.items():
        b.set(b.fp8([name]))
        costs[name] = calibration.kl_cost(b.reference, from_layer(index))[0].kl_mean
        print(f"{name} {costs[name]:.3e} ({time.perf_counter() - started:.0f} s)", flush=True)
    b.set({})
    figures["linears"] = costs
    top = sorted(costs, key=lambda n: -costs[n] / b.flops[n])[:12]
    lines += ["", "| linear alone in FP8 (most KL per FLOP first) | KL mean |", "|---|---|"]
    lines += [f"| {n} | {costs[n]:.2e} |" for n in top]


def shares(b: Bench, lines: list, figures: dict) -> None:
    model = copy.deepcopy(b.model)
    linears = fp8.decoder_linears(model)
    originals = {n: e[3] for n, e in linears.items()}
    fp8.quantize_model(model, fp8.Fp8Plan())
    quantized = {n: e[3] for n, e in fp8.decoder_linears(model).items()}
    got = calibration.kl_shares(model, b.ids, b.reference, linears, originals, quantized)
    figures["shares"] = got
    lines += ["", f"Gradient shares on the evaluation text (sum {sum(got.values()):.3e}):", "",
              "| kind | sum of shares | share per FLOP (relative) |", "|---|---|---|"]
    per_flop = {k: sum(got[n] for n in got if n.endswith(k)) / sum(b.flops[n] for n in got if n.endswith(k))
                for k in fp8.LINEAR_NAMES}
    top = max(per_flop.values())
    for kind in fp8.LINEAR_NAMES:
        lines.append(f"| {kind} | {sum(got[n] for n in got if n.endswith(kind)):.2e} | {per_flop[kind] / top:.2f} |")
    lines += ["", "| layer | sum of shares |", "|---|---|"]
    for i in range(len(fp8.decoder_layers(model))):
        lines.append(f"| {i} | {sum(got[n] for n, e in linears.items() if e[0] == i):.2e} |")


def methods(b: Bench, lines: list, figures: dict) -> None:
    lines += ["", "| method | FP8 share of linear FLOPs | KL mean | KL p99 | KL max | top-1 |", "|---|---|---|---|---|---|"]
    names = list(b.originals)

    def emit_row(label: str, share: float, cost: calibration.Cost) -> None:
        figures[f"methods/{label}"] = dict(cost.__dict__, share=share)
        lines.append(row(cost, label, f"{share:.1%}"))
        print(lines[-1], flush=True)

    b.set(b.fp8(names))
    emit_row("row (the served default before this study)", 1.0, b.cost())
    b.set(b.fp8(names, mean=True))
    emit_row("row, bias-corrected", 1.0, b.cost())
    b.set({n: Simulated(m, "row", "group", b.means[n]) for n, m in b.originals.items()})
    emit_row("1 x 128 activations (simulated), bias-corrected", 1.0, b.cost())
    smooth = _smoothing(b)
    b.set({n: Simulated(m, "row", "row", None, smooth[n]) for n, m in b.originals.items()})
    emit_row("row, SmoothQuant alpha 0.5 (simulated)", 1.0, b.cost())
    # Kept by position or kind, not by measurement.
    for label, kept in [("row, bias-corrected, layers 0 and 29 bf16",
                         [n for n, e in b.linears.items() if e[0] in (0, 29)]),
                        ("row, bias-corrected, attention linears bf16",
                         [n for n in names if n.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj", "o_proj")]),
                        ("row, bias-corrected, down_proj bf16", [n for n in names if n.endswith("down_proj")])]:
        fp8_names = [n for n in names if n not in kept]
        b.set(b.fp8(fp8_names, mean=True))
        emit_row(label, b.share(fp8_names), b.cost())
    b.set({})
    # Kept by the start-up calibration (chosen on the built-in sample, measured here).
    for bound in b.args.bounds:
        model = copy.deepcopy(b.model)
        started = time.perf_counter()
        try:
            done = calibration.quantize_and_measure(model, fp8.Fp8Plan(max_kl=bound), b.calib)
        except calibration.CalibrationError as e:
            lines.append(f"| calibrated, --fp8-max-kl {bound:g} | failed: {e} | | | | |")
            continue
        emit_row(f"row, bias-corrected, calibrated --fp8-max-kl {bound:g} ({time.perf_counter() - started:.0f} s, "
                 f"calibration KL {done.cost.kl_mean:.2e})", done.fp8_flop_share, b.cost(model))


def curve(b: Bench, lines: list, figures: dict) -> None:
    """KL at fixed FP8 shares for each method: the linears ranked once by the calibration's
    gradient shares per FLOP (row scales, on the calibration batch, as the teacher ranks them),
    the top ones kept in bf16 until the share is reached, the rest in FP8 by the method."""
    model = copy.deepcopy(b.model)
    linears = fp8.decoder_linears(model)
    originals = {n: e[3] for n, e in linears.items()}
    with torch.inference_mode():
        calib_ref = log_probs(model, b.calib)
    fp8.quantize_model(model, fp8.Fp8Plan(), b.means)
    quantized = {n: e[3] for n, e in fp8.decoder_linears(model).items()}
    got = calibration.kl_shares(model, b.calib, calib_ref, linears, originals, quantized)
    del model
    order = sorted(got, key=lambda n: -max(got[n], 0.0) / b.flops[n])
    smooth = _smoothing(b)
    make = {"row, bias-corrected": lambda n: fp8.FP8Linear.from_linear(b.originals[n], "row", input_mean=b.means[n]),
            "row, SmoothQuant 0.5, bias-corrected (simulated)":
                lambda n: Simulated(b.originals[n], "row", "row", b.means[n], smooth[n]),
            "1 x 128 activations, bias-corrected (simulated)":
                lambda n: Simulated(b.originals[n], "row", "group", b.means[n]),
            "1 x 128 weights and activations, bias-corrected (simulated)":
                lambda n: Simulated(b.originals[n], "group", "group", b.means[n])}
    total = sum(b.flops.values())
    lines += ["", "| method | " + " | ".join(f"KL at {t:.0%} FP8" for t in b.args.targets) + " |",
              "|---|" + "---|" * len(b.args.targets)]
    for label, build in make.items():
        cells = []
        for target in b.args.targets:
            kept, share = set(), 1.0
            for n in order:
                if share <= target + 1e-9:
                    break
                kept.add(n)
                share -= b.flops[n] / total
            b.set({n: build(n) for n in b.originals if n not in kept})
            cost = b.cost()
            figures[f"curve/{label}/{target}"] = dict(cost.__dict__, share=share)
            cells.append(f"{cost.kl_mean:.2e} ({share:.1%})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    b.set({})


def _smoothing(b: Bench, alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """SmoothQuant's factors per input channel: max|x|^alpha / max|w|^(1 - alpha), on the calibration batch."""
    amax = {}
    b.set({})
    hooks = [m.register_forward_pre_hook(
        lambda _m, args, n=n: amax.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]).float().abs().amax(0)))
        for n, m in b.originals.items()]
    log_probs(b.model, b.calib)
    for h in hooks:
        h.remove()
    out = {}
    for n, m in b.originals.items():
        w = m.weight.detach().float().abs().amax(0)
        out[n] = (amax[n].clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
    return out


SECTIONS = {"floor": floor, "wa": weights_and_acts, "outliers": outliers,
            "types": lambda b, l, f: types_and_layers(b, l, f, "types"),
            "layers": lambda b, l, f: types_and_layers(b, l, f, "layers"), "linears": per_linear, "shares": shares,
            "methods": methods, "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="floor,wa,outliers,types,layers,shares,methods")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--calibration-rows", type=int, default=4)
    parser.add_argument("--bounds", type=lambda s: [float(v) for v in s.split(",")], default=[2e-2, 1e-2, 5e-3])
    parser.add_argument("--targets", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 0.9, 0.75, 0.6],
                        help="the curve section's shares of linear FLOPs in FP8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b = Bench(args)
    lines = [f"SmolLM2-135M-Instruct, bf16, CPU (torch {torch.__version__}); {args.rows} x {args.seq} tokens of prose "
             "and Python source; KL(bf16 || X) per token, nats", ""]
    figures: dict = {}
    for section in args.sections.split(","):
        started = time.perf_counter()
        SECTIONS[section](b, lines, figures)
        print(f"[{section}: {time.perf_counter() - started:.0f} s]", flush=True)
    emit(lines, args.out, figures)


if __name__ == "__main__":
    main()
