"""EAGLE-3 draft training with its target in the same process, on one GPU: the colocated baseline.

    python -m bench.eagle3_colocated --out eagle3_colocated.md              # on an H200
    python -m bench.eagle3_colocated --shape tiny --seq-lens 64,128        # a check on the CPU

The target is Llama-3-8B-shaped (bench.distill_pipeline's TEACHER_SHAPE, vocabulary 128,256),
random bfloat16 weights built on the GPU; it runs in this process through
`student_trainer.local_teacher.LocalTeacher`, which derives the draft's inputs with the same
output kinds a teacher server uses (logits over the 32k draft vocabulary, its argmax, layers
2, 16 and 29 side by side). The draft is the project's (student_trainer/eagle3), trained as
`student-trainer eagle3 --bf16` trains it: float32 weights under bfloat16 autocast, 7 steps of
the training-time test, AdamW. One sequence per step, S tokens long, for each S of --seq-lens:
a warm-up step, then --steps timed steps, each the target's forward (no gradient) and the
draft's forward, backward and optimizer step. The table has tokens per second, the time of each
half, and the peak memory the CUDA allocator held; a length that runs out of memory says OOM.

The same training with the target served (`python -m teacher_server` on one GPU, the draft on
another) is the comparison this baseline is for; it needs two GPUs.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.distill_pipeline import TEACHER_SHAPE, VOCAB
from bench.table import emit
from distill_common.outputs import Argmax, AuxHiddenStates, SubsetLogits, default_aux_layers
from student_trainer.eagle3.loss import Eagle3Training, TeacherTargets
from student_trainer.eagle3.model import Eagle3Draft
from student_trainer.local_teacher import LocalTeacher

SHAPES = {
    "llama3-8b": dict(vocab_size=VOCAB, max_position_embeddings=32768, **TEACHER_SHAPE),
    # The CPU check: every code path, tiny sizes.
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
}
DRAFT_VOCAB = {"llama3-8b": 32000, "tiny": 256}


def build_target(shape: str, device: torch.device):
    """Random bfloat16 weights (float32 on the CPU), built where they run."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_length(teacher: LocalTeacher, training: Eagle3Training, optimizer, length: int, steps: int,
               device: torch.device) -> dict:
    """Tokens/s and the two halves' times over `steps` timed steps (after one warm-up step)."""
    vocab = teacher.outputs.teacher.vocab_size
    generator = torch.Generator().manual_seed(length)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    target_s = draft_s = 0.0
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (1, length), generator=generator)
        mask = torch.ones_like(ids)
        synchronize(device)
        started = time.perf_counter()
        out = teacher.submit(ids, mask).result(timeout=0)  # LocalTeacher resolves it before returning
        synchronize(device)
        middle = time.perf_counter()
        with autocast:
            result = training(out.aux_hidden_states, ids.to(device), mask.to(device), mask.to(device),
                              TeacherTargets(out.subset_logits, out.argmax))
        result.total().backward()
        del out, result
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step:  # the first is the warm-up
            target_s += middle - started
            draft_s += time.perf_counter() - middle
    return {"tokens_per_s": steps * length / (target_s + draft_s), "target_ms": 1e3 * target_s / steps,
            "draft_ms": 1e3 * draft_s / steps}


def measure(shape: str, lengths: list[int], steps: int, ttt_steps: int, device: torch.device,
            chunk_scores: int) -> tuple[str, list[dict]]:
    """The run's description and one row per length: `length`, then `oom` True, or `tokens_per_s`,
    `target_ms`, `draft_ms` and `peak_gib` (None on the CPU). Everything it built is freed on return."""
    torch.set_float32_matmul_precision("high")  # TF32 for the draft attention's float32 matmuls
    target = build_target(shape, device)
    config = target.config
    layers = default_aux_layers(config.num_hidden_layers)
    draft_vocab = DRAFT_VOCAB[shape]
    used = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(1))[:draft_vocab].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    teacher = LocalTeacher(target, (SubsetLogits(used.tolist()), AuxHiddenStates(layers), Argmax()))
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: an 8B target's embedding is 2 GiB in float32
        draft = Eagle3Draft.for_target(config, target.get_input_embeddings().weight.detach(),
                                       used - torch.arange(draft_vocab, device="cpu"), t2d, layers)
    draft.chunk_scores = chunk_scores
    training = Eagle3Training(draft, ttt_steps)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)

    rows = []
    for length in lengths:
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            figures = run_length(teacher, training, optimizer, length, steps, device)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            rows.append({"length": length, "oom": True})
            print(f"S={length}: out of memory", flush=True)
            continue
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        rows.append({"length": length, "oom": False, **figures, "peak_gib": peak})
        print(f"S={length}: {rows[-1]}", flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    about = (f"EAGLE-3 draft training, target in the same process ({shape}, {name}): draft of "
             f"{trainable / 1e6:.1f}M trainable parameters, {draft_vocab} draft ids, {ttt_steps} TTT steps, "
             f"aux layers {layers}, 1 sequence per step, {steps} timed steps")
    return about, rows


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384,32768", help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length (after a warm-up step)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-scores", type=int, default=1 << 28,
                        help="attention scores held per query chunk of the draft (float32 elements)")
    parser.add_argument("--out", default="", help="also write the table here")
    args = parser.parse_args(argv)
    about, rows = measure(args.shape, [int(x) for x in args.seq_lens.split(",")], args.steps, args.ttt_steps,
                          torch.device(args.device), args.chunk_scores)
    lines = [f"| {r['length']} | OOM | | | |" if r["oom"] else
             f"| {r['length']} | {r['tokens_per_s']:,.0f} | {r['target_ms']:.0f} | {r['draft_ms']:.0f} | "
             f"{gib(r['peak_gib'])} |" for r in rows]
    emit([about, "", "| tokens per sequence | tokens/s | target forward ms | draft step ms | peak GiB |",
          "|---:|---:|---:|---:|---:|", *lines], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
