"""Whole-pipeline distillation speed vs each side alone, measured in one run.

A Llama-3-8B-shaped teacher (random weights, bf16) is served on --teacher-gpu; a
1.5B-shaped student (random weights, tied 128k vocabulary) trains on
--student-gpu with KD on full logits (alpha 0.7) + CE, bf16 autocast, gradient
checkpointing, 2 x 4096 tokens a step. Three figures, tokens/s:
  teacher alone   a client on the student GPU only receiving outputs (forward + transfer)
  student alone   train steps against a fixed teacher-logit tensor already on the GPU
  pipeline        train steps with the teacher's outputs prefetched (--prefetch ahead)
The bar is pipeline >= 90% of min(teacher alone, student alone).

    python -m bench.distill_pipeline --steps 12 --out table.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.table import emit  # noqa: E402
from teacher_server.launcher import multicast_off  # noqa: E402

VOCAB = 128256
TEACHER_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0)
STUDENT_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, tie_word_embeddings=True)


class SyntheticBatches:
    """Random token batches, endless; what BatchIterator offers the prefetcher."""

    def __init__(self, rows: int, seq: int, seed: int = 0, vocab: int = VOCAB):
        self.rows, self.seq, self.vocab = rows, seq, vocab
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {}

    def __next__(self) -> dict:
        ids = torch.randint(0, self.vocab, (self.rows, self.seq), generator=self.generator)
        ones = torch.ones_like(ids)
        return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def write_config(path: Path, shape: dict) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, max_position_embeddings=8192, **shape).save_pretrained(path)
    return f"random:{path}"


def small_teacher_spec() -> str:
    """The student's 1.5B shape as a small teacher (random weights): benches of the forward alone."""
    return write_config(Path(tempfile.mkdtemp()) / "1.5b", STUDENT_SHAPE)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--teacher-gpu", type=int, default=0)
    p.add_argument("--student-gpu", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    multicast_off(os.environ)

    from distill_common.models import load_causal_lm
    from student_trainer import TeacherClient, TeacherOutput
    from student_trainer.config import TrainConfig
    from student_trainer.train import StudentMaps, TeacherPrefetcher, train_micro_batch
    from teacher_server.launcher import ServerProcess

    tmp = Path(tempfile.mkdtemp())
    teacher_spec = write_config(tmp / "teacher", TEACHER_SHAPE)
    student_spec = write_config(tmp / "student", STUDENT_SHAPE)
    tokens_per_step = args.rows * args.seq
    device = torch.device("cuda", args.student_gpu)
    torch.cuda.set_device(device)
    cfg = TrainConfig(teacher="bench", model=student_spec, data="synthetic", kd_weight=0.7, loss="forward_kl",
                      bf16=True, grad_checkpointing=True, prefetch=args.prefetch, seq_len=args.seq,
                      batch_size=args.rows)

    server = ServerProcess("--model", teacher_spec, "--device", f"cuda:{args.teacher_gpu}", "--dtype", "bfloat16",
                           "--max-batch-tokens", str(tokens_per_step * 2), "--max-seq-len", str(args.seq),
                           startup_timeout_s=300)
    results = {}
    try:
        teacher = TeacherClient(server.address, device, max_inflight=args.prefetch + 1,
                                job_id="bench-pipeline")

        # 1. Teacher alone: outputs received and dropped, prefetch+1 in flight.
        batches = SyntheticBatches(args.rows, args.seq)
        futures: deque = deque()
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                while futures:
                    futures.popleft().result(timeout=600)
                start = time.perf_counter()
            futures.append(teacher.submit(next(batches)["input_ids"]))
            while len(futures) > args.prefetch:
                futures.popleft().result(timeout=600)
        while futures:
            futures.popleft().result(timeout=600)
        results["teacher alone"] = args.steps * tokens_per_step / (time.perf_counter() - start)

        # 2 and 3. The student, built once, trained against a fixed tensor, then the teacher.
        model = load_causal_lm(student_spec, device=device, dtype=torch.float32)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        fixed = TeacherOutput(batch_id=0, logits=torch.randn(args.rows, args.seq, VOCAB, device=device,
                                                             dtype=torch.bfloat16))

        def run(next_batch) -> float:
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    torch.cuda.synchronize(device)
                    start = time.perf_counter()
                batch, out = next_batch()
                train_micro_batch(cfg, model, batch, out, autocast, device, StudentMaps(), None)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            return args.steps * tokens_per_step / (time.perf_counter() - start)

        gc.collect()
        gc.freeze()  # as the training loop does (student_trainer/loop.py)
        torch.cuda.reset_peak_memory_stats(device)
        student_batches = SyntheticBatches(args.rows, args.seq, seed=1)
        results["student alone"] = run(lambda: (next(student_batches), fixed))
        student_peak = torch.cuda.max_memory_allocated(device)
        del fixed
        prefetcher = TeacherPrefetcher(teacher, SyntheticBatches(args.rows, args.seq, seed=2), args.prefetch, 600)
        waits = []

        def from_teacher():
            batch, out, wait_s = prefetcher.next()
            waits.append(wait_s)
            return batch, out

        results["pipeline"] = run(from_teacher)
        teacher.close(timeout_s=60)
    finally:
        server.stop()

    floor = min(results["teacher alone"], results["student alone"])
    lines = [f"8B-shaped teacher on GPU {args.teacher_gpu}, 1.5B-shaped student on GPU {args.student_gpu}, "
             f"{args.rows} x {args.seq} tokens a step, full bf16 logits, prefetch {args.prefetch}, "
             f"{args.steps} timed steps after {args.warmup}, {torch.cuda.get_device_name(device)}",
             "| run | tokens/s | vs min(teacher, student) |", "|---|---|---|"]
    for name, value in results.items():
        lines.append(f"| {name} | {value:,.0f} | {value / floor:.1%} |")
    timed_waits = waits[args.warmup:]
    lines.append(f"\nstudent peak memory {student_peak / 2**30:.1f} GiB; pipeline waited for the teacher "
                 f"{sum(timed_waits) / max(1, len(timed_waits)) * 1000:.0f} ms per step on average")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
