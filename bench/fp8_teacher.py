"""What serving the teacher in FP8 gains and costs, in one run on one GPU.

    python3 -m bench.fp8_teacher --out fp8_teacher.md

Speed: a Llama-3-8B-shaped teacher (random bf16 weights built on the GPU: speed does not
depend on what the weights learned) at 2 x 4096 and 4 x 8192 tokens, forward as the server
calls it (no mask, no cache, logits out): tokens/s, the share of the peak (model FLOPs as
DESIGN.md counts them: 2 x linear parameters x tokens + 2 x S^2 x hidden per layer for causal
attention; the FP8 linears against 2 x 790 TFLOP/s, the rest against 790) and peak memory, for
bf16 (eager, and its decoder layers compiled) and the FP8 variants of teacher_server/fp8.py:

  eager     the activation quantization as separate eager kernels
  qcompile  the quantization function compiled on its own
  layers    each decoder layer compiled, the quantization fused into what produces it
  served    layers, through the server's own ModelRunner (its start-up probe, host ids in)
  model     the whole forward compiled at once

(`+keep`: the first --keep decoder layers left in bf16; `+fastacc`: row products with cuBLAS's
fast accumulation; `+plan`: the linears a calibrated plan keeps in bf16 (--plan FILE, chosen on
SmolLM2 by the smollm2 section below or by a teacher's --fp8-max-kl), mapped onto the 8B shape's
layers by relative depth, so its share of FP8 FLOPs and its pattern are timed; `+bc`: bias
correction, a bias on every FP8 product, as the start-up calibration adds), and torchao's float8 on the same linears (`ao-SCALING-MODE`: its
Float8DynamicActivationFloat8WeightConfig with row or 1 x 128 / 128 x 128 block scales, as its
defaults have it (fast accumulation for row scales) or with `+nofastacc` (accumulated as
teacher_server/fp8.py does): the library weighed against our own path; `pip install torchao`,
carried to the GPU machine as a wheel in .whl/).
Before timing, what each variant's first decoder layer adds to its input on one fixed sequence
is compared with bf16's (relative error: a wrong product would time as fast as a right one; the
logits of 32 random layers say less, every FP8 variant moves them by about 65%).

Quality: random weights say nothing about what FP8 does to a distribution, so a small Llama
(--teacher-layers x --teacher-hidden) is trained for --train-s seconds on the demo's corpus (the
Python standard library's source, distill_demo/corpus.py, held-out files apart) with the demo's
tokenizer. On held-out text: per-token KL(bf16 || FP8) (mean, p99, max; float32 reductions),
top-1 agreement and held-out CE for each scaling (and bf16 against float32, the floor), then the
held-out CE of a student distilled from the bf16 teacher and from each FP8 one (same seeds,
same steps, --seeds of them). With --torchao, torchao's float8 is measured there too.

A real teacher (--sections smollm2): SmolLM2-135M-Instruct (distill_common/smollm2.py builds it
from its PyPI package), KL(bf16 || FP8) on --smollm2-rows sequences of English prose and Python
source for row scales, bias-corrected, and the plans the start-up calibration keeps for each of
--smollm2-bounds (written as fp8_plan_smollm2_BOUND.json beside --out, for the '+plan' speed
variants); with --smollm2-student-steps, students distilled from it in bf16 and in FP8
(--smollm2-student-teachers; each teacher's last hidden states computed once over a pool of
--smollm2-pool training windows, its head applied at each step, each seed drawing its own batches). The
kept plan's speed on the 8B shape, at 2 x 4096:

    python3 -m bench.fp8_teacher --sections smollm2 --device cpu --out smollm2.md
    python3 -m bench.fp8_teacher --sections speed --shapes 2x4096 --plan fp8_plan_smollm2_0.01.json \\
        --variants bf16,row-layers,row-layers+bc,row-layers+bc+plan
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import time

import torch
import torch.nn.functional as F

from bench.cuda_timing import median_call_ms
from bench.table import emit
from teacher_server import fp8
from teacher_server.fp8_calibration import fp8_flop_share

DEVICE = "cuda"  # --device cpu: a smoke test of the quality section
BF16_PEAK = 790e12  # H200 dense bf16, as measured here (DESIGN.md); FP8 is twice that
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)


def llama(shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)


def torchao_quantize(model, scaling: str, fast_accum: bool | None = None) -> int:
    """torchao's float8 (dynamic per-row or 1 x 128 activation scales, per-channel or 128 x 128
    weight scales) on the linears teacher_server/fp8.py quantizes; returns how many. `fast_accum`
    None keeps torchao's default (fast accumulation for row scales, not for block scales). Its
    inductor settings are left alone (set_inductor_config=False) so that every variant compiles alike."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerBlock, PerRow, quantize_
    from torchao.float8.inference import Float8MMConfig

    granularity = PerRow() if scaling == "row" else [PerBlock([1, fp8.BLOCK]), PerBlock([fp8.BLOCK, fp8.BLOCK])]
    mm = {} if fast_accum is None else {"mm_config": Float8MMConfig(use_fast_accum=fast_accum)}
    config = Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False, **mm)
    names = set()

    def chosen(module, fqn: str) -> bool:
        pick = isinstance(module, torch.nn.Linear) and fqn.rsplit(".", 1)[-1] in fp8.LINEAR_NAMES
        if pick:
            names.add(fqn)
        return pick

    quantize_(model, config, filter_fn=chosen)
    return len(names)


# ---- speed -----------------------------------------------------------------------------------

def flops(shape: dict, rows: int, seq: int, fp8_share: float) -> tuple[float, float]:
    """(FLOPs at the FP8 rate, FLOPs at the bf16 rate) of one forward, `fp8_share` of the
    decoder's linear FLOPs in FP8."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    tokens = rows * seq
    linear = 2 * per_layer * tokens * layers
    attention = 2 * seq * seq * h * rows * layers
    head = 2 * h * shape["vocab_size"] * tokens
    return linear * fp8_share, linear * (1 - fp8_share) + attention + head


def plan_for(model, path: str) -> tuple[str, ...]:
    """The linears a calibrated plan keeps in bf16 (--plan: JSON with "keep_linears", or a teacher's
    /v1/status "quantization" object with "full_precision_linears", and "num_layers", the layer count
    of the model it was chosen on), mapped onto `model`'s layers by relative depth: the same kinds
    of linear kept at the same places, so the timed forward has the plan's share and pattern."""
    import json
    import re

    if not path:
        raise SystemExit("a '+plan' variant needs --plan FILE (bench/investigations/fp8_smollm2.py writes one per bound)")
    raw = json.loads(open(path).read())
    names = raw.get("keep_linears", raw.get("full_precision_linears"))
    source_layers = int(raw["num_layers"])
    target_layers = len(fp8.decoder_layers(model))
    mapped = set()
    for name in names:
        match = re.fullmatch(r"(.*layers\.)(\d+)(\..*)", name)
        if match is None:
            raise SystemExit(f"--plan {path}: {name!r} names no decoder layer")
        index = round(int(match.group(2)) * (target_layers - 1) / max(source_layers - 1, 1))
        mapped.add(f"{match.group(1)}{index}{match.group(3)}")
    return tuple(sorted(mapped))


def time_forward(model, rows: int, seq: int, vocab: int, iters: int, runner=None) -> tuple[float, float]:
    """(median ms, peak GiB) of the logits forward: the model called as above, or, given `runner`
    (a ModelRunner over it), the server's own forward from host ids."""
    ids = torch.randint(vocab, (rows, seq), device="cuda")
    host_ids, mask = ids.cpu().pin_memory(), torch.ones(rows, seq, dtype=torch.long)

    @torch.inference_mode()
    def forward():
        if runner is not None:
            return runner.forward(host_ids, mask).logits
        return model(input_ids=ids, use_cache=False, return_dict=True).logits

    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return median_call_ms(forward, iters), torch.cuda.max_memory_allocated() / 2**30


def parse(variant: str) -> tuple[str, str, str, set]:
    """'bf16' / 'bf16c' / [ao-]SCALING-MODE[+option...] -> (library, scaling, mode, options)."""
    library, rest = ("torchao", variant[3:]) if variant.startswith("ao-") else ("ours", variant)
    rest, *options = rest.split("+")
    if not rest.startswith(("row", "block")):
        return library, "", rest, set(options)
    scaling, _, mode = rest.partition("-")
    return library, scaling, mode or "eager", set(options)


@torch.inference_mode()
def first_layer_out(model) -> torch.Tensor:
    ids = torch.randint(LLAMA3_8B["vocab_size"], (1, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    hidden = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    return (hidden[1] - hidden[0]).float()  # what the layer adds to its residual (the embedding would drown it)


def speed(args, rows_out: list, figures: dict) -> None:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    baseline, reference = {}, None
    for variant in args.variants.split(","):
        torch._dynamo.reset()
        model = llama(LLAMA3_8B, torch.bfloat16, "cuda")
        library, scaling, mode, options = parse(variant)
        share = 0.0
        if reference is None:
            reference = first_layer_out(model)  # the same weights every variant starts from (seed 0)
        try:
            if library == "torchao":
                fast_accum = False if "nofastacc" in options else None
                share = torchao_quantize(model, scaling, fast_accum) / len(fp8.LINEAR_NAMES) / LLAMA3_8B[
                    "num_hidden_layers"]
            elif scaling:
                keep = tuple(range(args.keep)) if args.keep and "keep" in options else ()
                # +plan: the linears a calibrated plan keeps in bf16 (--plan); +bc: bias correction (a bias
                # on every FP8 product; its value does not change the time: zero means here).
                plan = fp8.Fp8Plan(scaling, keep, fast_accum="fastacc" in options,
                                   keep_linears=plan_for(model, args.plan) if "plan" in options else ())
                means = ({name: torch.zeros(entry[3].in_features, device="cuda")
                          for name, entry in fp8.decoder_linears(model).items()} if "bc" in options else None)
                fp8.quantize_model(model, plan, means)
                share = fp8_flop_share(model)
                fp8.verify(model, torch.bfloat16)  # a wrong product would time as fast as a right one
            error = ((first_layer_out(model) - reference).norm() / reference.norm()).item()
        except Exception as e:  # a variant this torch, GPU or install cannot run: its row says why
            rows_out.append(f"| {variant} | | | failed: {type(e).__name__}: {str(e).splitlines()[0][:160]} | | | | | |")
            print(rows_out[-1], flush=True)
            del model
            torch.cuda.empty_cache()
            continue
        runner = None
        if mode == "qcompile":
            fp8.compile_quantization(model)
        elif mode == "model":  # the whole forward compiled, as torchao's own examples do
            model.compile()
        elif mode in ("layers", "bf16c", "served"):
            fp8.compile_layers(model, block=scaling == "block")  # torchao's linears are not FP8Linear
        if mode == "served":  # what `teacher-server --quantize fp8` runs: its start-up probe included
            from teacher_server.model_runner import ModelRunner

            runner = ModelRunner("llama3-8b-shaped", f"cuda:{torch.cuda.current_device()}", model=model)
        started = time.perf_counter()
        for rows, seq in shapes:
            try:
                ms, gib = time_forward(model, rows, seq, LLAMA3_8B["vocab_size"], args.iters, runner)
            except Exception as e:  # a variant this torch cannot run: its row says why
                rows_out.append(f"| {variant} | {rows} x {seq} | | failed: {str(e).splitlines()[0][:120]} | | | | | |")
                print(f"{variant} {rows}x{seq} failed: {e}", flush=True)
                continue
            fast, slow = flops(LLAMA3_8B, rows, seq, share)
            tokens_s = rows * seq / ms * 1e3
            baseline.setdefault((rows, seq), tokens_s)
            ratio = tokens_s / baseline[(rows, seq)]
            peak_share = (fast / (2 * BF16_PEAK) + slow / BF16_PEAK) * 1e3 / ms
            rows_out.append(f"| {variant} | {rows} x {seq} | {share:.0%} | {ms:.1f} | {tokens_s / 1e3:.1f}k | "
                            f"{ratio:.2f}x | {peak_share:.0%} | {gib:.1f} | {error:.1e} |")
            figures[f"{variant}/{rows}x{seq}"] = dict(ms=ms, tokens_s=tokens_s, ratio=ratio, share=peak_share,
                                                       fp8_flop_share=share, gib=gib, layer0_rel_error=error)
            print(rows_out[-1], f"({time.perf_counter() - started:.0f} s with compile)", flush=True)
        if args.profile and variant == args.profile:
            profile(model, shapes[0], args.out_dir)
        del model, runner
        gc.collect()  # a compiled model's cycles hold its weights: the next variant's peak memory is its own
        torch.cuda.empty_cache()


def profile(model, shape, out_dir: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = torch.randint(LLAMA3_8B["vocab_size"], shape, device="cuda")
    with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(table)
    if out_dir:
        with open(f"{out_dir}/fp8_profile.txt", "w") as f:
            f.write(table)


# ---- quality ---------------------------------------------------------------------------------

def corpus_ids(vocab: int):
    from distill_demo.corpus import split_files, stdlib_files, stdlib_root
    from distill_demo.tokenizer import train_tokenizer

    root = stdlib_root()
    files = {str(p.relative_to(root)): p for p in stdlib_files()}
    heldout = split_files(sorted(files), 0.05, seed=0)
    texts = {name: path.read_text(errors="replace") for name, path in files.items()}
    tokenizer = train_tokenizer([texts[n] for n in sorted(texts) if n not in heldout], vocab_size=vocab)
    eos = tokenizer.convert_tokens_to_ids("<|eos|>")

    def stream(names):
        ids = []
        for name in sorted(names):
            ids.extend(tokenizer(texts[name], add_special_tokens=False)["input_ids"] + [eos])
        return torch.tensor(ids, dtype=torch.long)

    return stream(set(texts) - heldout), stream(heldout), len(tokenizer)


def llama_shape(layers: int, hidden: int) -> dict:
    """A Llama of `layers` x `hidden`: heads of 64, SwiGLU width 8/3 of hidden (a multiple of 64)."""
    return dict(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)


def batches(ids: torch.Tensor, rows: int, seq: int, generator: torch.Generator):
    while True:
        starts = torch.randint(len(ids) - seq - 1, (rows,), generator=generator)
        yield torch.stack([ids[s:s + seq + 1] for s in starts.tolist()]).to(DEVICE)


def train(model, data, seconds: float, lr: float, teacher=None, steps: int = 0, after_step=None,
          warmup_steps: int = 100) -> int:
    """Trains `model` (float32 weights, bf16 autocast) on next tokens, or on `teacher`'s
    distribution (forward KL) when given or when `data` yields (ids, teacher log-probabilities)
    pairs; for `steps` steps (cosine decay to a tenth), else for `seconds`; linear warm-up over
    `warmup_steps`. `after_step(step)` is called after each step."""
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = steps or 10**9
    started, step = time.perf_counter(), 0
    while step < total and (steps or time.perf_counter() - started < seconds):
        warm = min(1.0, (step + 1) / warmup_steps)
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, step / total))) if steps else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * warm * max(decay, 0.1)
        batch, target = next(data), None
        if isinstance(batch, tuple):  # ids and the teacher's log-probabilities, computed ahead
            batch, target = batch
        elif teacher is not None:
            with torch.no_grad():
                target = teacher(input_ids=batch[:, :-1], use_cache=False).logits.float().log_softmax(-1)
        with torch.autocast(batch.device.type, torch.bfloat16):
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
        if target is None:
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        else:
            loss = F.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean") / batch.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if after_step is not None:
            after_step(step)
    model.eval().requires_grad_(False)
    return step


@torch.inference_mode()
def log_probs(model, heldout: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=heldout[i:i + 8, :-1], use_cache=False).logits.float().log_softmax(-1)
                      for i in range(0, len(heldout), 8)])


def compare(reference: torch.Tensor, other: torch.Tensor, labels: torch.Tensor) -> dict:
    kl = (reference.exp() * (reference - other)).sum(-1).flatten()  # float32 throughout
    return dict(kl_mean=kl.mean().item(), kl_p99=kl.quantile(0.99).item() if kl.numel() <= 2**24 else float("nan"),
                kl_max=kl.max().item(), top1=(reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
                ce=F.nll_loss(other.flatten(0, 1), labels.flatten()).item())


@torch.inference_mode()
def held_out_ce(model, heldout: torch.Tensor) -> float:
    return F.nll_loss(log_probs(model, heldout).flatten(0, 1), heldout[:, 1:].flatten()).item()


def quality(args, rows_out: list, figures: dict) -> None:
    train_ids, heldout_ids, vocab = corpus_ids(args.vocab)
    seq = args.seq
    n = min(args.heldout_rows, (len(heldout_ids) - 1) // (seq + 1))
    heldout = heldout_ids[:n * (seq + 1)].reshape(n, seq + 1).to(DEVICE)
    shape = dict(vocab_size=vocab, max_position_embeddings=seq, **llama_shape(args.teacher_layers, args.teacher_hidden))
    teacher32 = llama(shape, torch.float32, DEVICE)
    steps = train(teacher32, batches(train_ids, args.batch_rows, seq, torch.Generator().manual_seed(0)),
                  args.train_s, lr=1e-3)
    teacher = copy.deepcopy(teacher32).to(torch.bfloat16)
    labels = heldout[:, 1:]
    ref = log_probs(teacher, heldout)
    floor = compare(log_probs(teacher32, heldout), ref, labels)
    del teacher32
    print(f"teacher {args.teacher_layers} x {args.teacher_hidden}, vocab {vocab}: {steps} steps in "
          f"{args.train_s:.0f} s, held-out CE bf16 {compare(ref, ref, labels)['ce']:.3f}", flush=True)
    rows_out.append(f"| bf16 vs float32 (floor) | {floor['kl_mean']:.2e} | {floor['kl_p99']:.2e} | "
                    f"{floor['kl_max']:.2e} | {floor['top1']:.2%} | {compare(ref, ref, labels)['ce']:.4f} |")
    figures["floor"] = floor
    # The most sensitive layers: each quantized alone.
    alone = []
    for layer in range(args.teacher_layers):
        model = copy.deepcopy(teacher)
        keep = tuple(i for i in range(args.teacher_layers) if i != layer)
        fp8.quantize_model(model, fp8.Fp8Plan("row", keep))
        alone.append(compare(ref, log_probs(model, heldout), labels)["kl_mean"])
    sensitive = tuple(sorted(range(args.teacher_layers), key=lambda i: -alone[i])[:args.keep])
    print("KL with one layer in FP8 (row):", " ".join(f"{i}:{kl:.1e}" for i, kl in enumerate(alone)), flush=True)
    figures["kl_one_layer"] = alone
    plans = {"row": fp8.Fp8Plan("row"), "row, fast accumulation": fp8.Fp8Plan("row", fast_accum=True),
             "block": fp8.Fp8Plan("block"),
             f"row, layers {','.join(map(str, sensitive))} bf16": fp8.Fp8Plan("row", sensitive),
             f"row, first {args.keep} bf16": fp8.Fp8Plan("row", tuple(range(args.keep))),
             f"block, layers {','.join(map(str, sensitive))} bf16": fp8.Fp8Plan("block", sensitive)}
    if args.torchao:  # torchao's float8 on the same linears, eager (its compiled forward computes the same)
        plans.update({"torchao row": lambda m: torchao_quantize(m, "row"),
                      "torchao row, no fast accumulation": lambda m: torchao_quantize(m, "row", False),
                      "torchao block": lambda m: torchao_quantize(m, "block")})
    teachers = {"bf16": teacher}
    for name, plan in plans.items():
        model = copy.deepcopy(teacher)
        try:
            if callable(plan):
                plan(model)
            else:
                fp8.quantize_model(model, plan)
                fp8.verify(model, torch.bfloat16)
            got = compare(ref, log_probs(model, heldout), labels)
        except Exception as e:  # a scaling this torch or GPU cannot run: its row says why
            rows_out.append(f"| {name} | failed: {str(e).splitlines()[0][:100]} | | | | |")
            print(f"{name} failed: {e}", flush=True)
            continue
        teachers[name] = model
        figures[f"kl/{name}"] = got
        rows_out.append(f"| {name} | {got['kl_mean']:.2e} | {got['kl_p99']:.2e} | {got['kl_max']:.2e} | "
                        f"{got['top1']:.2%} | {got['ce']:.4f} |")
        print(rows_out[-1], flush=True)
    # Students distilled from each teacher: same seeds, same batches, same steps.
    if not args.students:
        return
    student_shape = dict(shape, **llama_shape(args.student_layers, args.student_hidden))
    rows_out.append("")
    rows_out.append(f"Students ({args.student_layers} x {args.student_hidden}, {args.student_steps} steps of "
                    f"{args.batch_rows} x {seq} tokens, forward KL to the teacher): held-out CE per seed")
    rows_out.append("")
    rows_out.append("| teacher | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | mean | spread |")
    rows_out.append("|---|" + "---|" * (args.seeds + 2))
    ranked = sorted((n for n in teachers if n not in ("bf16", "row")), key=lambda n: figures[f"kl/{n}"]["kl_mean"])
    for name in (["bf16", "row"] + ranked)[:args.students]:
        ces = []
        for seed in range(args.seeds):
            student = llama(student_shape, torch.float32, DEVICE, seed=100 + seed)
            train(student, batches(train_ids, args.batch_rows, seq, torch.Generator().manual_seed(100 + seed)), 0,
                  lr=2e-3, teacher=teachers[name], steps=args.student_steps)
            ces.append(held_out_ce(student, heldout))
            del student
        figures[f"student/{name}"] = ces
        rows_out.append(f"| {name} | " + " | ".join(f"{c:.4f}" for c in ces) +
                        f" | {sum(ces) / len(ces):.4f} | {max(ces) - min(ces):.4f} |")
        print(rows_out[-1], flush=True)


# ---- a real teacher: SmolLM2-135M-Instruct -----------------------------------------------------

# Evaluation text: English prose (the language reference's, in Python's pydoc_data.topics) and Python
# source (standard-library modules); the start-up calibration's built-in sample is other text.
PROSE_TOPICS = ("execmodel", "calls", "import", "types", "class", "exceptions")
SOURCE_FILES = ("textwrap.py", "heapq.py", "fractions.py", "statistics.py", "shlex.py", "calendar.py")


def smollm2_texts() -> tuple[str, str]:
    import sysconfig
    from pathlib import Path

    import pydoc_data.topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return ("\n\n".join(pydoc_data.topics.topics[name] for name in PROSE_TOPICS),
            "\n\n".join((stdlib / name).read_text() for name in SOURCE_FILES))


def smollm2_eval_batch(tokenizer, rows: int, seq: int) -> torch.Tensor:
    """`rows` x `seq` ids, half prose and half source, windows spread over each text."""
    out = []
    for text in smollm2_texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        count = rows // 2
        stride = (len(ids) - seq) // count
        out += [ids[i * stride:i * stride + seq] for i in range(count)]
    return torch.tensor(out, dtype=torch.long)


def smollm2_train_ids(tokenizer) -> torch.Tensor:
    """Students' training text: standard-library source and language-reference prose, the
    evaluation's files and topics left out."""
    import sysconfig
    from pathlib import Path

    import pydoc_data.topics

    from distill_demo.corpus import stdlib_files

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [text for name, text in sorted(pydoc_data.topics.topics.items()) if name not in PROSE_TOPICS]
    texts += [p.read_text(errors="replace") for p in stdlib_files()[:400]
              if p.relative_to(stdlib).as_posix() not in SOURCE_FILES]
    eos = tokenizer.eos_token_id
    ids = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def smollm2(args, rows_out: list, figures: dict) -> None:
    """KL(bf16 || FP8) on SmolLM2-135M-Instruct for the served plans (eager, on DEVICE), the
    calibrated plans written to --out's folder for '+plan' speed variants, and, with
    --smollm2-student-steps, students distilled from bf16 and from each calibrated plan."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill_common.smollm2 import model_dir
    from teacher_server import fp8_calibration as calibration

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    heldout = smollm2_eval_batch(tokenizer, args.smollm2_rows, args.smollm2_seq + 1).to(DEVICE)
    labels = heldout[:, 1:]
    calib = calibration.calibration_batch(tokenizer, calibration.calibration_texts(""), 4, 256,
                                          teacher.config.vocab_size)
    ref = log_probs(teacher, heldout)
    model32 = copy.deepcopy(teacher).float()
    floor = compare(log_probs(model32, heldout), ref, labels)
    del model32
    rows_out.append(f"| bf16 vs float32 (floor) | | {floor['kl_mean']:.2e} | {floor['kl_p99']:.2e} | "
                    f"{floor['kl_max']:.2e} | {floor['top1']:.2%} | {compare(ref, ref, labels)['ce']:.4f} |")
    figures["smollm2/floor"] = floor
    teachers = {"bf16": teacher}
    plans = {"row": fp8.Fp8Plan("row", bias_correction=False), "row, bias-corrected": fp8.Fp8Plan("row")}
    plans.update({f"row, bias-corrected, --fp8-max-kl {b:g}": fp8.Fp8Plan("row", max_kl=b) for b in args.smollm2_bounds})
    for name, plan in plans.items():
        model = copy.deepcopy(teacher)
        done = calibration.quantize_and_measure(model, plan, calib.to(DEVICE))
        got = compare(ref, log_probs(model, heldout), labels)
        figures[f"smollm2/{name}"] = dict(got, fp8_flop_share=done.fp8_flop_share, calibration_s=done.seconds,
                                          calibration_kl=done.cost.kl_mean, keep_linears=done.plan.keep_linears)
        rows_out.append(f"| {name} | {done.fp8_flop_share:.1%} | {got['kl_mean']:.2e} | {got['kl_p99']:.2e} | "
                        f"{got['kl_max']:.2e} | {got['top1']:.2%} | {got['ce']:.4f} |")
        print(rows_out[-1], f"(calibration {done.seconds:.0f} s, KL {done.cost.kl_mean:.2e} on its batch)", flush=True)
        if plan.max_kl and args.out_dir:
            with open(f"{args.out_dir}/fp8_plan_smollm2_{plan.max_kl:g}.json", "w") as f:
                json.dump({"num_layers": len(fp8.decoder_layers(model)), "keep_linears": done.plan.keep_linears,
                           "fp8_flop_share": done.fp8_flop_share}, f, indent=1)
        teachers[name] = model
    if not args.smollm2_student_steps:
        return
    students(args, tokenizer, teachers, heldout, rows_out, figures)


@torch.inference_mode()
def final_hidden(model, windows: torch.Tensor, rows: int = 4) -> torch.Tensor:
    """The teacher's last normed hidden state [N, S, H] on `windows` [N, S] (the input to its
    head, which FP8 leaves in the model's dtype): the teacher's distribution for a fraction of
    the memory of its logits."""
    decoder = model.get_decoder()
    return torch.cat([decoder(input_ids=windows[i:i + rows], use_cache=False).last_hidden_state
                      for i in range(0, len(windows), rows)])


def distilled_batches(windows: torch.Tensor, hidden: torch.Tensor, head, rows: int, generator: torch.Generator):
    """`rows` windows drawn at random (the student's seed) with the teacher's log-probabilities:
    its head applied to its cached hidden states, as in its own forward."""
    while True:
        picked = torch.randint(len(windows), (rows,), generator=generator)
        with torch.no_grad():
            target = head(hidden[picked]).float().log_softmax(-1)
        yield windows[picked].to(DEVICE), target


# --smollm2-student-teachers' names for the KL table's rows (a number: the calibrated plan of that bound).
STUDENT_TEACHERS = {"bf16": "bf16", "row": "row", "row+bc": "row, bias-corrected"}


def students(args, tokenizer, teachers: dict, heldout: torch.Tensor, rows_out: list, figures: dict) -> None:
    """Students distilled from SmolLM2 in bf16 and in FP8 (--smollm2-student-teachers): each
    teacher runs once over a fixed pool of --smollm2-pool windows of training text (its FP8 linears
    as served: quantize_and_measure above, the server's own path), and each seed draws its own
    batches from that pool (with its own initial weights; warm-up over a tenth of the steps); held-out
    CE before, halfway and at the end."""
    pool_rows = args.smollm2_pool
    train_ids = smollm2_train_ids(tokenizer)
    seq = args.smollm2_seq
    starts = torch.randint(len(train_ids) - seq - 1, (pool_rows,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([train_ids[s:s + seq + 1] for s in starts.tolist()])
    shape = dict(vocab_size=teachers["bf16"].config.vocab_size, max_position_embeddings=seq,
                 **llama_shape(args.student_layers, args.student_hidden))
    steps = args.smollm2_student_steps
    if steps < 2:
        raise SystemExit("--smollm2-student-steps: at least 2 (the students' held-out CE is measured halfway too)")
    try:
        names = [STUDENT_TEACHERS.get(key) or f"row, bias-corrected, --fp8-max-kl {float(key):g}"
                 for key in args.smollm2_student_teachers]
    except ValueError:
        names = [""]
    missing = [n for n in names if n not in teachers]
    if missing:
        raise SystemExit(f"--smollm2-student-teachers: no teacher {missing}: give bf16, row, row+bc or one of "
                         "--smollm2-bounds")
    untrained = [held_out_ce(llama(shape, torch.float32, DEVICE, seed=100 + seed), heldout) for seed in range(args.seeds)]
    figures["smollm2/student/untrained"] = untrained
    rows_out += ["", f"Students of SmolLM2 ({args.student_layers} x {args.student_hidden}, {steps} steps of "
                 f"{args.batch_rows} x {seq} tokens drawn from {pool_rows} windows of {seq} tokens, forward KL to the "
                 f"teacher): held-out CE per seed at the end (halfway in brackets); untrained: "
                 + ", ".join(f"{c:.3f}" for c in untrained), "",
                 "| teacher | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | mean | spread |",
                 "|---|" + "---|" * (args.seeds + 2)]
    for name in names:
        started = time.perf_counter()
        hidden = final_hidden(teachers[name], windows[:, :-1].to(DEVICE))
        print(f"{name}: teacher over the pool ({pool_rows} x {seq} tokens) in {time.perf_counter() - started:.0f} s",
              flush=True)
        head = teachers[name].get_output_embeddings()
        ces, halfway = [], []
        for seed in range(args.seeds):
            started = time.perf_counter()
            student = llama(shape, torch.float32, DEVICE, seed=100 + seed)
            data = distilled_batches(windows, hidden, head, args.batch_rows, torch.Generator().manual_seed(100 + seed))
            train(student, data, 0, lr=2e-3, steps=steps, warmup_steps=max(1, steps // 10),
                  after_step=lambda step: step == steps // 2 and halfway.append(held_out_ce(student, heldout)))
            ces.append(held_out_ce(student, heldout))
            print(f"{name}, seed {seed}: held-out CE {halfway[-1]:.4f} at step {steps // 2}, {ces[-1]:.4f} at {steps} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            del student
        figures[f"smollm2/student/{name}"] = ces
        figures[f"smollm2/student/{name}/halfway"] = halfway
        rows_out.append(f"| {name} | " + " | ".join(f"{c:.4f} ({h:.3f})" for c, h in zip(ces, halfway)) +
                        f" | {sum(ces) / len(ces):.4f} | {max(ces) - min(ces):.4f} |")
        print(rows_out[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="speed,quality")
    parser.add_argument("--shapes", default="2x4096,4x8192", help="ROWSxSEQ,... of the 8B-shaped forward")
    parser.add_argument("--variants", help="bf16, bf16c (layers compiled), SCALING-MODE[+keep]",
                        default="bf16,bf16c,row-eager,row-qcompile,row-layers,block-layers,row-layers+keep")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="decoder layers kept in bf16 by the '+keep' plans")
    parser.add_argument("--profile", default="", help="a variant to profile at the first shape")
    parser.add_argument("--plan", default="", help="the '+plan' variants' calibrated plan: JSON with keep_linears "
                        "(or full_precision_linears) and num_layers, e.g. from bench/investigations/fp8_smollm2.py")
    parser.add_argument("--train-s", type=float, default=100.0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch-rows", type=int, default=32)
    parser.add_argument("--heldout-rows", type=int, default=128)
    parser.add_argument("--teacher-layers", type=int, default=12)
    parser.add_argument("--teacher-hidden", type=int, default=768)
    parser.add_argument("--student-layers", type=int, default=4)
    parser.add_argument("--student-hidden", type=int, default=384)
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--students", type=int, default=3, help="teachers a student is distilled from (bf16 first)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--torchao", action="store_true", help="torchao's float8 in the quality section too")
    parser.add_argument("--smollm2-rows", type=int, default=8, help="the smollm2 section's held-out sequences")
    parser.add_argument("--smollm2-seq", type=int, default=256, help="their tokens (and the students')")
    parser.add_argument("--smollm2-bounds", type=lambda v: [float(x) for x in v.split(",") if x],
                        default=[2e-2, 1e-2, 5e-3], help="--fp8-max-kl values of the smollm2 section's plans")
    parser.add_argument("--smollm2-student-steps", type=int, default=0,
                        help="students distilled from SmolLM2 in bf16 and in FP8 (0: none)")
    parser.add_argument("--smollm2-student-teachers", type=lambda v: [x for x in v.split(",") if x],
                        default=["bf16", "row+bc", "0.02"], help="the smollm2 students' teachers: bf16, row (no bias "
                        "correction), row+bc (bias-corrected, as served by default), a bound of --smollm2-bounds (the "
                        "plan calibrated for it)")
    parser.add_argument("--smollm2-pool", type=int, default=128,
                        help="windows of training text the smollm2 students' batches are drawn from (each teacher "
                        "runs over them once)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    args.out_dir = str(__import__("pathlib").Path(args.out).parent) if args.out else ""
    figures: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__}
    lines = [f"FP8 teacher on {figures['device']} (torch {torch.__version__})", ""]
    if "speed" in args.sections:
        table = ["| variant | tokens | linear FLOPs in FP8 | ms | tokens/s | vs bf16 | share of peak | peak GiB | "
                 "layer 0 vs bf16 |", "|---|---|---|---|---|---|---|---|---|"]
        speed(args, table, figures)
        lines += ["Llama-3-8B-shaped forward (random weights), logits out:", ""] + table + [""]
    if "quality" in args.sections:
        table = ["| teacher vs bf16 | KL mean | KL p99 | KL max | top-1 agree | held-out CE |",
                 "|---|---|---|---|---|---|"]
        quality(args, table, figures)
        lines += [f"Trained {args.teacher_layers} x {args.teacher_hidden} Llama, {args.heldout_rows} held-out "
                  f"sequences of {args.seq} tokens (nats per token, float32):", ""] + table
    if "smollm2" in args.sections:
        table = ["| teacher vs bf16 | linear FLOPs in FP8 | KL mean | KL p99 | KL max | top-1 agree | held-out CE |",
                 "|---|---|---|---|---|---|---|"]
        smollm2(args, table, figures)
        lines += ["", f"SmolLM2-135M-Instruct, {args.smollm2_rows} held-out sequences of {args.smollm2_seq} tokens of prose "
                  "and Python source (nats per token, float32):", ""] + table
    emit(lines, args.out, figures)


if __name__ == "__main__":
    main()
