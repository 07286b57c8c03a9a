"""EAGLE-3 draft training with its target in the same process, on one GPU: the colocated baseline.

    python -m bench.eagle3_colocated --out eagle3_colocated.md              # on an H200
    python -m bench.eagle3_colocated --shape tiny --seq-lens 64,128        # a check on the CPU

The target is Llama-3-8B-shaped (bench.distill_pipeline's TEACHER_SHAPE, vocabulary 128,256),
random bfloat16 weights built on the GPU; it runs in this process through
`student_trainer.local_teacher.LocalTeacher`, which derives the draft's inputs with the same
output kinds a teacher server uses (logits over the 32k draft vocabulary, its argmax, layers
2, 16 and 29 side by side). The draft is the project's (student_trainer/eagle3): 7 steps of
the training-time test, AdamW, one sequence per step, S tokens long, for each S of --seq-lens: a
warm-up step, then --steps timed steps, each the target's forward (no gradient) and the draft's
forward, backward and optimizer step. Two ways of training the draft, one after the other in the
same run on the same inputs (--paths):

- `reference`: float32 weights under bfloat16 autocast, the unroll's attention in query chunks
  (`ttt_attention`), AdamW over the float32 weights;
- `fused`: bfloat16 weights with float32 master weights in a fused AdamW
  (student_trainer/eagle3/precision.py), the unroll's attention one causal kernel per step merged
  with its diagonal (`merged_ttt_attention`, --attention picks the kernel), and, as the trainer
  does on CUDA (`--compile auto`), the draft layer's elementwise work and the loss chunks through
  torch.compile (--compile picks: on, off, loss, layer).

The table has, per length and path, tokens per second, the time of each half, each half's model
FLOPs per second and share of the device's bf16 peak (--peak-tflops; docs/eagle3.md has the
formula), the peak memory the CUDA allocator held, and the host synchronizations the draft's step
made (counted by CUDA's sync debug mode). A length that runs out of memory says OOM and in which
phase. Then each step's loss on both paths: the same draft initialisation and inputs, so the
two trajectories differ only by rounding. --profile-dir writes a torch.profiler table of the top
kernels of one fused step at each of --profile-lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
import warnings
from pathlib import Path

import torch

from bench.distill_pipeline import TEACHER_SHAPE, VOCAB
from bench.table import emit
from distill_common.outputs import Argmax, AuxHiddenStates, SubsetLogits, default_aux_layers
from student_trainer.eagle3.loss import Eagle3Training, TeacherTargets
from student_trainer.eagle3.model import Eagle3Draft
from student_trainer.eagle3.precision import MasterWeights
from student_trainer.local_teacher import LocalTeacher

SHAPES = {
    "llama3-8b": dict(vocab_size=VOCAB, max_position_embeddings=65536, **TEACHER_SHAPE),
    # The CPU check: every code path, tiny sizes.
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
}
DRAFT_VOCAB = {"llama3-8b": 32000, "tiny": 256}
PATHS = ("reference", "fused")
H200_BF16_TFLOPS = 790.0  # dense bf16 matrix rate measured on this workplace's H200 (device KINDS.md)


def build_target(shape: str, device: torch.device):
    """Random bfloat16 weights (float32 on the CPU), built where they run."""
    from transformers import LlamaConfig

    from bench.models import random_model

    return random_model(LlamaConfig(**SHAPES[shape]), device, torch.bfloat16 if device.type == "cuda" else torch.float32)


# ---- model FLOPs (docs/eagle3.md) ------------------------------------------------------------


def draft_step_flops(draft: Eagle3Draft, length: int, ttt_steps: int) -> float:
    """One training step of the draft over one sequence: 6 x the trainable parameters each unroll
    step multiplies by x tokens (the layer and the head every step, fc once), and 3 x 2 x S^2 x
    (heads x head_dim) per unroll step for its causal attention (forward 2 S^2 d: QK^T and PV over
    half of the S^2 pairs; backward twice that). Recomputation is not counted."""
    layer = sum(p.numel() for p in draft.midlayer.parameters()) + draft.lm_head.weight.numel()
    fc = draft.fc.weight.numel()
    width = draft.config.num_attention_heads * draft.config.head_dim
    return 6.0 * (layer * ttt_steps + fc) * length + 3 * 2.0 * length ** 2 * width * ttt_steps


def target_forward_flops(target, length: int) -> float:
    """The target's forward over one sequence: 2 x its parameters but the embedding (the head over
    the whole vocabulary included: the argmax reads it) x tokens, plus 2 x S^2 x width per layer
    for causal attention."""
    config = target.config
    params = sum(p.numel() for name, p in target.named_parameters() if "embed_tokens" not in name)
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return 2.0 * params * length + 2.0 * length ** 2 * width * config.num_hidden_layers


# ---- one path ----------------------------------------------------------------------------------


class DraftPath:
    """The draft, its optimizer and how a step runs, for one of PATHS."""

    def __init__(self, path: str, config, embedding, d2t, t2d, layers, ttt_steps: int, device: torch.device,
                 attention: str, chunk_scores: int, compile_loss: bool, compile_layer: bool):
        self.path, self.device = path, device
        torch.manual_seed(0)
        with torch.device(device):  # built where it trains: an 8B target's embedding is 2 GiB in float32
            draft = Eagle3Draft.for_target(config, embedding, d2t, t2d, layers)
        draft.chunk_scores = chunk_scores
        params = [p for p in draft.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in params)
        half = device.type == "cuda"
        if path == "reference":
            draft.attention = "reference"
            self.master = None
            self.optimizer = torch.optim.AdamW(params, lr=1e-4)
            self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if half else contextlib.nullcontext()
        else:
            draft.attention = attention if half else "math"
            if half:
                draft.to(torch.bfloat16)  # the float buffers too; d2t and t2d are integers, the rotary is kept out
            if compile_layer:
                draft.compile_layer()
            self.master = MasterWeights(params)
            self.optimizer = torch.optim.AdamW(self.master.master, lr=1e-4, fused=half)
            self.autocast = contextlib.nullcontext()
        self.draft = draft
        self.training = Eagle3Training(draft, ttt_steps, compile_loss=compile_loss and path == "fused")

    def step(self, out, ids, mask) -> torch.Tensor:
        """Forward, backward, optimizer step; the loss (a tensor: reading it would synchronize)."""
        with self.autocast:
            result = self.training(out.aux_hidden_states, ids, mask, mask, TeacherTargets(out.subset_logits, out.argmax))
        loss = result.total()
        loss.backward()
        del result
        if self.master is not None:
            self.master.grads_to_master()
        self.optimizer.step()
        if self.master is not None:
            self.master.master_to_params()
            self.master.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def counting_syncs(device: torch.device, counter: list):
    """Appends the number of synchronizing CUDA calls made inside (CUDA's sync debug mode)."""
    if device.type != "cuda":
        counter.append(0)
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counter.append(sum("synchroniz" in str(w.message) for w in caught))


class Phase:
    """Which phase of a step is running, for the out-of-memory report."""
    name = "-"


def run_length(teacher: LocalTeacher, draft: DraftPath, length: int, steps: int, device: torch.device,
               phase: Phase) -> dict:
    """Tokens/s, the two halves' times and each step's loss over `steps` timed steps (after one
    warm-up step, whose loss is listed too)."""
    vocab = teacher.outputs.teacher.vocab_size
    generator = torch.Generator().manual_seed(length)
    target_s = draft_s = 0.0
    losses, syncs = [], []
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (1, length), generator=generator)
        mask = torch.ones_like(ids)
        synchronize(device)
        started = time.perf_counter()
        phase.name = "target forward"
        out = teacher.submit(ids, mask).result(timeout=0)  # LocalTeacher resolves it before returning
        synchronize(device)
        middle = time.perf_counter()
        phase.name = "draft step"
        ids, mask = ids.to(device), mask.to(device)  # the batch's upload is not the step's
        with counting_syncs(device, syncs):
            loss = draft.step(out, ids, mask)
        del out
        synchronize(device)
        if step:  # the first is the warm-up
            target_s += middle - started
            draft_s += time.perf_counter() - middle
        losses.append(loss.item())
    return {"tokens_per_s": steps * length / (target_s + draft_s), "target_ms": 1e3 * target_s / steps,
            "draft_ms": 1e3 * draft_s / steps, "losses": losses, "syncs": max(syncs[1:] or syncs)}


def profile_step(teacher: LocalTeacher, draft: DraftPath, length: int, path: Path) -> None:
    """One more step under torch.profiler: the top kernels by device time, the kernel count and
    the share of matrix products, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, teacher.outputs.teacher.vocab_size, (1, length), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    out = teacher.submit(ids, mask).result(timeout=0)
    synchronize(draft.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        draft.step(out, ids.to(draft.device), mask.to(draft.device))
        synchronize(draft.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels) or 1.0

    def share(*words: str) -> float:
        return 100 * sum(e.self_device_time_total for e in kernels if any(w in e.name.lower() for w in words)) / total_us

    summary = (f"S={length}, {draft.path} path: {len(kernels)} kernels, {total_us / 1e3:.1f} ms of kernel time; "
               f"matrix products {share('gemm', 'xmma', 'cutlass', 'nvjet', 'matmul'):.1f}%, attention kernels "
               f"{share('flash', 'fmha', 'cudnn', 'attn'):.1f}%")
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=100)
    path.write_text(summary + "\n\n" + table + "\n")
    print(summary, flush=True)


def measure(shape: str, lengths: list[int], steps: int, ttt_steps: int, device: torch.device, paths: list[str],
            attention: str, chunk_scores: int, profile_lengths: list[int], profile_dir: str,
            compile_loss: bool = False, compile_layer: bool = False) -> tuple[str, list[dict]]:
    """The run's description and one row per path and length: `path`, `length`, then `oom` (the
    phase that ran out) or the figures. Everything it built is freed on return."""
    torch.set_float32_matmul_precision("high")  # TF32 for the reference attention's float32 matmuls
    target = build_target(shape, device)
    config = target.config
    layers = default_aux_layers(config.num_hidden_layers)
    draft_vocab = DRAFT_VOCAB[shape]
    used = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    teacher = LocalTeacher(target, (SubsetLogits(used.tolist()), AuxHiddenStates(layers), Argmax()))
    embedding = target.get_input_embeddings().weight.detach()
    rows, trainable = [], 0
    for path in paths:
        draft = DraftPath(path, config, embedding, used - torch.arange(draft_vocab), t2d, layers, ttt_steps, device,
                          attention, chunk_scores, compile_loss, compile_layer)
        trainable = draft.trainable
        phase = Phase()
        for length in lengths:
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            row = {"path": path, "length": length}
            try:
                figures = run_length(teacher, draft, length, steps, device, phase)
            except torch.cuda.OutOfMemoryError:
                draft.optimizer.zero_grad(set_to_none=True)
                if draft.master is not None:
                    draft.master.zero_grad()
                rows.append({**row, "oom": phase.name})
                print(f"{path} S={length}: out of memory in the {phase.name}", flush=True)
                continue
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            draft_tflops = draft_step_flops(draft.draft, length, ttt_steps) / figures["draft_ms"] / 1e9
            target_tflops = target_forward_flops(target, length) / figures["target_ms"] / 1e9
            rows.append({**row, "oom": None, **figures, "peak_gib": peak, "draft_tflops": draft_tflops,
                         "target_tflops": target_tflops})
            print(f"{path} S={length}: {rows[-1]}", flush=True)
            if profile_dir and path == "fused" and length in profile_lengths:
                profile_step(teacher, draft, length, Path(profile_dir) / f"profile_{path}_{length}.txt")
        del draft
        gc.collect()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    about = (f"EAGLE-3 draft training, target in the same process ({shape}, {name}): draft of "
             f"{trainable / 1e6:.1f}M trainable parameters, {draft_vocab} draft ids, {ttt_steps} TTT steps, "
             f"aux layers {layers}, 1 sequence per step, {steps} timed steps; fused path: {attention} attention kernel, "
             f"loss chunks {'compiled' if compile_loss else 'eager'}, layer {'compiled' if compile_layer else 'eager'}")
    return about, rows


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[dict], peak_tflops: float) -> list[str]:
    lines = ["| tokens per sequence | path | tokens/s | target forward ms | target TFLOP/s (% peak) | draft step ms | "
             "draft TFLOP/s (% peak) | peak GiB | host syncs in the draft step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["oom"]:
            lines.append(f"| {r['length']} | {r['path']} | OOM in the {r['oom']} | | | | | | |")
            continue
        lines.append(f"| {r['length']} | {r['path']} | {r['tokens_per_s']:,.0f} | {r['target_ms']:.0f} | "
                     f"{r['target_tflops']:.0f} ({100 * r['target_tflops'] / peak_tflops:.0f}%) | {r['draft_ms']:.0f} | "
                     f"{r['draft_tflops']:.0f} ({100 * r['draft_tflops'] / peak_tflops:.0f}%) | {gib(r['peak_gib'])} | "
                     f"{r['syncs']} |")
    return lines


def loss_table(rows: list[dict]) -> list[str]:
    """Each step's loss on each path (warm-up step first), and the largest relative difference, at
    every length both paths ran."""
    by = {(r["path"], r["length"]): r for r in rows if not r["oom"]}
    # The lengths both paths ran (one may run out of memory where the other does not).
    lengths = sorted(n for path, n in by if path == "reference" and ("fused", n) in by)
    if not lengths:
        return []
    lines = ["", "| tokens per sequence | step | reference loss | fused loss | relative difference |", "|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for n in lengths:
        for i, (a, b) in enumerate(zip(by[("reference", n)]["losses"], by[("fused", n)]["losses"])):
            diff = abs(a - b) / abs(a)
            worst = max(worst, diff)
            lines.append(f"| {n} | {i} | {a:.5f} | {b:.5f} | {diff:.2e} |")
    return lines + ["", f"largest relative difference of a step's loss: {worst:.2e}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384,32768,65536", help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length (after a warm-up step)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"which of {PATHS}, in this order")
    parser.add_argument("--attention", default="flash", help="the fused path's causal kernel: flash or cudnn")
    parser.add_argument("--chunk-scores", type=int, default=1 << 28,
                        help="attention scores held per query chunk of the reference path (float32 elements)")
    parser.add_argument("--compile", choices=("on", "off", "loss", "layer"), default="on",
                        help="what of the fused path runs through torch.compile: its loss chunks and draft layer "
                             "(on, as the trainer on CUDA), neither, or one")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="the device's bf16 peak")
    parser.add_argument("--profile-dir", default="", help="write a profile of one fused step here")
    parser.add_argument("--profile-lengths", default="2048,16384")
    parser.add_argument("--out", default="", help="also write the table here")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths: one or more of {PATHS}")
    about, rows = measure(args.shape, [int(x) for x in args.seq_lens.split(",")], args.steps, args.ttt_steps,
                          torch.device(args.device), paths, args.attention, args.chunk_scores,
                          [int(x) for x in args.profile_lengths.split(",") if x], args.profile_dir,
                          args.compile in ("on", "loss"), args.compile in ("on", "layer"))
    emit([about, "", *table(rows, args.peak_tflops), *loss_table(rows)], args.out, figures=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
