"""The seed recipe with its teacher served on another GPU, against each side alone and against the
teacher in the student's process (docs/performance.md, "The seed recipe served on two GPUs").

A deepseek-coder-6.7b-shaped teacher and student (the model's config, random bf16 weights), LoRA r16
on the student, 0.7 KD + 0.2 attention + 0.1 hidden, bf16, gradient checkpointing (the trainer's
settings: bench/recipe_student.py's `recipe_config`). Teacher and student are built from the same
config and seed, so the student starts as the teacher (LoRA's B starts at zero) and the losses start
near 0: the work of a step does not depend on the values. For each shape and mode (full logits, or the
teacher's final hidden state with its head applied on the student), four runs:

  teacher alone  a client on the student's GPU receiving the recipe's outputs (Logits or FinalHidden,
                 HiddenStates, AttentionInputs, as the trainer asks them) from a teacher server on
                 the other GPU, --prefetch + 1 batches in flight, dropped as they come
  student alone  the trainer's step on teacher outputs held on its GPU (--prefetch + 1 of them)
  served         the trainer's step with its prefetcher (TeacherPrefetcher, --prefetch ahead)
                 against the served teacher
  colocated      the teacher model in the student's process on the student's GPU
                 (student_trainer/local_teacher.py: the server's forward), computing each batch's
                 outputs right before its step, as a trainer that holds both models does

Peak GiB on each GPU (the student's from this process, reset per run; the teacher's from the
server's /metrics, its peak since start-up: one server per shape, head on student before full logits,
so each reading is the run's own: the full-logit forward does what the decoder-only one does and more),
tokens/s, and served as a percentage of min(teacher alone, student alone). The bar (issue 19): at
4 x 4096 each GPU <= 40 GiB and served >= 90% of that minimum.

    python -m bench.recipe_served --teacher-gpu 0 --student-gpu 1 --out recipe_served.md
    python -m bench.recipe_served --tiny      # tiny models on CPU over gloo: checks that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the programs do
import torch  # noqa: E402

from bench.table import emit  # noqa: E402
from bench.distill_pipeline import SyntheticBatches  # noqa: E402
from bench.recipe_student import (DEEPSEEK_CODER_6_7B, MODES, TINY, RecipeStep, build_recipe_student,  # noqa: E402
                                  fake_teacher_outputs, recipe_config, teacher_bytes, timed_steps)
from teacher_server.launcher import multicast_off  # noqa: E402

RUNS = ("teacher alone", "student alone", "served", "colocated")
# Modes in the order they run on one server: the teacher's peak since start-up is then each run's own.
RUN_ORDER = ("head", "full")
# The longest wait for one batch's outputs: a 6.7B forward of 4 x 8192 tokens takes about a second.
OUTPUTS_TIMEOUT_S = 300.0


def gib(nbytes: float) -> float:
    return nbytes / 2**30


class StudentGPU:
    """The student's device: its peak memory per run (nothing to read on a CPU)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> dict:
        if not self.cuda:
            return {}
        return {"student_peak_allocated_gib": gib(torch.cuda.max_memory_allocated(self.device)),
                "student_peak_reserved_gib": gib(torch.cuda.max_memory_reserved(self.device))}


def teacher_peak(server) -> dict:
    """The served teacher's peak GPU memory since start-up, from its /metrics (none on a CPU)."""
    from teacher_server.launcher import metrics_samples

    samples = metrics_samples(server.http, timeout_s=10)
    allocated = samples.get(("teacher_gpu_memory_peak_allocated_bytes", ()), 0.0)
    if not allocated:
        return {}
    return {"teacher_peak_allocated_gib": gib(allocated),
            "teacher_peak_reserved_gib": gib(samples[("teacher_gpu_memory_peak_reserved_bytes", ())])}


def teacher_alone(teacher, batches, inflight: int, steps: int, warmup: int) -> float:
    """Tokens/s of the teacher's outputs received on the student's device, `inflight` batches asked ahead."""
    futures: deque = deque()
    tokens = batches.rows * batches.seq
    for step in range(warmup + steps):
        if step == warmup:
            while futures:
                futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
            start = time.perf_counter()
        batch = next(batches)
        futures.append(teacher.submit(batch["input_ids"], batch["attention_mask"]))
        while len(futures) >= inflight:
            futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
    while futures:
        futures.popleft().result(timeout=OUTPUTS_TIMEOUT_S)
    return steps * tokens / (time.perf_counter() - start)


def train_run(step: RecipeStep, next_pair, batch: int, seq: int, args, device) -> dict:
    timed, losses = timed_steps(step, next_pair, args.steps, args.warmup, device)
    step_s = sum(timed) / len(timed)
    return {"tokens_per_s": batch * seq / step_s, "step_s": step_s, "last_losses": losses}


def oom_guard(run, student: StudentGPU, model) -> dict:
    """`run()`'s figures, or {"oom": True} when the student's GPU ran out of memory (the row says OOM)."""
    try:
        return run()
    except torch.cuda.OutOfMemoryError as e:
        model.zero_grad(set_to_none=True)
        print(f"out of memory: {str(e).splitlines()[0]}", flush=True)
        return {"oom": True}
    finally:
        student.reset()


def served_rows(server, model, student: StudentGPU, config: dict, spec: str, mode: str, batch: int, seq: int,
                args, device) -> list[dict]:
    """Teacher alone, student alone and served, for one shape and mode, on one session."""
    from student_trainer import TeacherClient
    from student_trainer.train import TeacherPrefetcher, teacher_outputs

    cfg = recipe_config(spec, mode, batch, seq, config["num_hidden_layers"], args.relation_heads)
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    common = {"tokens": f"{batch} x {seq}", "mode": MODES[mode], "teacher_bytes_per_step": teacher_bytes(cfg, config)}
    rows = []
    with TeacherClient(server.address, device, outputs=teacher_outputs(cfg), vocab_size=vocab,
                       max_inflight=args.prefetch + 1, job_id=f"recipe-{mode}-{batch}x{seq}",
                       transfer_timeout_s=OUTPUTS_TIMEOUT_S) as teacher:
        student.reset()
        speed = teacher_alone(teacher, SyntheticBatches(batch, seq, seed=1, vocab=vocab), args.prefetch + 1,
                              args.steps, args.warmup)
        rows.append({**common, "run": "teacher alone", "tokens_per_s": speed, **student.peak(), **teacher_peak(server)})

        def alone() -> dict:
            outputs = [fake_teacher_outputs(cfg, config, device, seed) for seed in range(args.prefetch + 1)]
            step = RecipeStep(cfg, model, layers, hidden, outputs[0][1], device, args.warmup + args.steps)
            data = SyntheticBatches(batch, seq, seed=2, vocab=vocab)
            drawn = iter(range(args.warmup + args.steps))

            def next_pair():
                out, head = outputs[next(drawn) % len(outputs)]
                step.maps.head = head
                return next(data), out

            return {**train_run(step, next_pair, batch, seq, args, device), **student.peak()}

        rows.append({**common, "run": "student alone", **oom_guard(alone, student, model)})

        def served() -> dict:
            # The head arrived once, at join (FinalHidden): the trainer's maps take it from there.
            step = RecipeStep(cfg, model, teacher.info.num_layers, teacher.info.hidden_size, teacher.joined.head,
                              device, args.warmup + args.steps)
            prefetcher = TeacherPrefetcher(teacher, SyntheticBatches(batch, seq, seed=3, vocab=vocab), args.prefetch,
                                           OUTPUTS_TIMEOUT_S)
            waits = []

            def next_pair():
                data, out, wait_s = prefetcher.next()
                waits.append(wait_s)
                return data, out

            figures = train_run(step, next_pair, batch, seq, args, device)
            timed_waits = waits[args.warmup:]
            # Receive what the prefetcher asked ahead, so the session ends with nothing in flight.
            prefetcher.depth = 0
            for _ in prefetcher.drawn_ahead():
                prefetcher.next()
            return {**figures, **student.peak(), "teacher_wait_s": sum(timed_waits) / len(timed_waits)}

        rows.append({**common, "run": "served", **oom_guard(served, student, model), **teacher_peak(server)})
    return rows


def colocated_row(teacher_model, model, student: StudentGPU, config: dict, spec: str, mode: str, batch: int,
                  seq: int, args, device) -> dict:
    """The teacher in this process on the student's GPU: each batch's outputs computed right before
    its step (prefetch 0: computing ahead would only hold more outputs, the GPU runs one thing at a time)."""
    from student_trainer.local_teacher import LocalTeacher
    from student_trainer.train import TeacherPrefetcher, teacher_outputs

    cfg = recipe_config(spec, mode, batch, seq, config["num_hidden_layers"], args.relation_heads)
    common = {"tokens": f"{batch} x {seq}", "mode": MODES[mode], "run": "colocated",
              "teacher_bytes_per_step": teacher_bytes(cfg, config)}

    def run() -> dict:
        teacher = LocalTeacher(teacher_model, teacher_outputs(cfg))
        step = RecipeStep(cfg, model, teacher.info.num_layers, teacher.info.hidden_size, teacher.joined.head, device,
                          args.warmup + args.steps)
        prefetcher = TeacherPrefetcher(teacher, SyntheticBatches(batch, seq, seed=4, vocab=config["vocab_size"]), 0,
                                       OUTPUTS_TIMEOUT_S)

        def next_pair():
            data, out, _ = prefetcher.next()
            return data, out

        return {**train_run(step, next_pair, batch, seq, args, device), **student.peak()}

    return {**common, **oom_guard(run, student, model)}


def speed_ratios(results: list[dict]) -> None:
    """Adds `vs_min`: each run's tokens/s over min(teacher alone, student alone) of its shape and mode."""
    for key in {(r["tokens"], r["mode"]) for r in results}:
        rows = {r["run"]: r for r in results if (r["tokens"], r["mode"]) == key}
        alone = [rows[name].get("tokens_per_s") for name in ("teacher alone", "student alone") if name in rows]
        if len(alone) == 2 and all(alone):
            for row in rows.values():
                if row.get("tokens_per_s"):
                    row["vs_min"] = row["tokens_per_s"] / min(alone)


def render(results: list[dict], modes: list[str], shapes: list[str]) -> str:
    def memory(row: dict, who: str) -> str:
        if row.get("oom") and who == "student":
            return "OOM"
        if f"{who}_peak_allocated_gib" not in row:
            return "-"
        return f"{row[f'{who}_peak_allocated_gib']:.1f} ({row[f'{who}_peak_reserved_gib']:.1f})"

    header = ["tokens / step", "teacher sends", "run", "student GPU peak GiB", "teacher GPU peak GiB", "tokens/s",
              "vs min(teacher alone, student alone)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = {(shape, MODES[mode], run): i for i, (shape, mode, run) in
             enumerate((s, m, r) for s in shapes for m in modes for r in RUNS)}
    for row in sorted(results, key=lambda r: order[(r["tokens"], r["mode"], r["run"])]):
        teacher = memory(row, "teacher") if row["run"] != "colocated" else "(on the student's GPU)"
        speed = "OOM" if row.get("oom") else f"{row['tokens_per_s']:,.0f}"
        ratio = f"{row['vs_min']:.1%}" if "vs_min" in row else "-"
        lines.append(f"| {row['tokens']} | {row['mode']} | {row['run']} | {memory(row, 'student')} | {teacher} | "
                     f"{speed} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_served", description=__doc__.split("\n")[0])
    parser.add_argument("--teacher-gpu", type=int, default=0)
    parser.add_argument("--student-gpu", type=int, default=1)
    parser.add_argument("--shapes", default="4x4096,4x8192", help="BATCHxSEQ, comma-separated")
    parser.add_argument("--modes", default="full,head", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)} "
                        "(teacher alone, student alone and served go together)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--prefetch", type=int, default=2, help="the trainer's --prefetch")
    parser.add_argument("--relation-heads", type=int, default=32, help="--attention-relation-heads")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="for each teacher server to be ready")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny models on CPU (server and student over gloo), shape 2x32: checks that it runs")
    parser.add_argument("--out", default="", help="also write the table (markdown) here, and the figures as JSON")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    runs = [r for r in args.runs.split(",") if r]
    if set(modes) - MODES.keys():
        parser.error(f"--modes: use {', '.join(MODES)}")
    if set(runs) - set(RUNS):
        parser.error(f"--runs: use {', '.join(RUNS)}")
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in ("2x32" if args.tiny else args.shapes).split(",")]
    config = TINY if args.tiny else DEEPSEEK_CODER_6_7B
    if args.tiny:
        args.relation_heads = 4
        device, teacher_device = torch.device("cpu"), "cpu"
    else:
        if args.teacher_gpu == args.student_gpu:
            parser.error("--teacher-gpu and --student-gpu must differ: the colocated run is the one-GPU case")
        device, teacher_device = torch.device("cuda", args.student_gpu), f"cuda:{args.teacher_gpu}"
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    multicast_off(os.environ)
    from distill_common.models import load_causal_lm
    from teacher_server.launcher import ServerProcess

    student = StudentGPU(device)
    results = []

    def record(row: dict) -> None:
        # Written as each run ends: a run cut short by its time limit keeps the figures it has.
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")

    ordered = [m for m in RUN_ORDER if m in modes]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        spec = f"random:{tmp}"
        # One student for every run: the runs differ in their maps and optimizer, not in the model.
        model = build_recipe_student(recipe_config(spec, "full", *shapes[0], config["num_hidden_layers"],
                                                   args.relation_heads), device)
        if {"teacher alone", "student alone", "served"} & set(runs):
            for batch, seq in shapes:
                # A server per shape, a batch per forward at most (--max-batch-tokens): the teacher's memory
                # is that of one batch's forward, and its peak since start-up that of this shape.
                server = ServerProcess("--model", spec, "--device", teacher_device, "--dtype", "bfloat16",
                                       "--max-batch-tokens", str(batch * seq), "--max-seq-len", str(seq),
                                       startup_timeout_s=args.startup_timeout_s)
                try:
                    for mode in ordered:
                        for row in served_rows(server, model, student, config, spec, mode, batch, seq, args, device):
                            record(row)
                finally:
                    server.stop()
        if "colocated" in runs:
            # Built after the served runs: until now the student's GPU held the student alone.
            teacher_model = load_causal_lm(spec, device=device, dtype=torch.bfloat16)
            for batch, seq in shapes:
                for mode in ordered:
                    record(colocated_row(teacher_model, model, student, config, spec, mode, batch, seq, args, device))
            del teacher_model
    speed_ratios(results)
    table = render(results, modes, [f"{b} x {s}" for b, s in shapes])
    where = ("CPU (tiny models, gloo)" if args.tiny else
             f"teacher on GPU {args.teacher_gpu}, student on GPU {args.student_gpu}, "
             f"{torch.cuda.get_device_name(device)}")
    print(f"\nthe seed recipe ({'tiny' if args.tiny else 'deepseek-coder-6.7b'}-shaped teacher and student, LoRA r16, "
          f"bf16, grad ckpt, 0.7 KD + 0.2 attention + 0.1 hidden), prefetch {args.prefetch}, {args.steps} timed steps "
          f"after {args.warmup}; {where}; peak GiB allocated (reserved)\n")
    emit(table.splitlines(), args.out, results)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
