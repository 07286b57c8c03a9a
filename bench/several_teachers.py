"""Step time with two teachers served at once against the slower one alone (CPU, one run).

Two teacher servers of different cost and a small student here (one thread) trained by the
trainer's own step
(`distill_step` over a `TeacherPrefetcher` of a `TeacherSet`, --prefetch micro-batches ahead on
every teacher): the same code for one teacher as for two, only the set differs. Three
configurations, taken in turns for --rounds rounds of --steps steps (after --warmup steps each),
short rounds, so that the load of a shared machine falls on all of them alike:

  slow alone    the slower teacher
  fast alone    the faster teacher
  both          both teachers, --teacher-combine sum: each micro-batch is sent to both before
                either is waited for, so a step should wait for the slower, not the sum

The bar: the median step of "both" <= 1.1x the median step of "slow alone" (also shown: the
median over rounds of each round's ratio, which a change of load between rounds moves less).

Two kinds of teacher (--teachers):
  cpu          random-weight Llamas of two sizes (SHAPES), one thread each, computing on the CPU.
               Each teacher needs a core of its own while the student trains on a third: on
               fewer free cores they take turns, and "both" measures the cores, not the trainer.
  device-like  one tiny model each whose forward also waits --slow-s / --fast-s per 1,000 tokens
               without using the CPU (bench/device_like_teacher.py), as a teacher on a GPU does:
               what the trainer's overlap of the teachers is worth, whatever the free cores.

    python -m bench.several_teachers [--teachers device-like|cpu] [--rounds 8 --steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.table import emit

VOCAB = 1024
SHAPES = {"slow": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6),
          "fast": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4),
          "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1)}
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)  # a device-like teacher's own forward


def write_config(path: Path, shape: dict) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                **shape).save_pretrained(path)
    return f"random:{path}"


class SyntheticBatches:
    """Random token batches, endless; what BatchIterator offers the prefetcher."""

    def __init__(self, rows: int, seq: int, seed: int):
        self.rows, self.seq = rows, seq
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {}

    def __next__(self) -> dict:
        ids = torch.randint(0, VOCAB, (self.rows, self.seq), generator=self.generator)
        ones = torch.ones_like(ids)
        return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--topk", type=int, default=8, help="ask both teachers for their top k (0: full logits)")
    p.add_argument("--teachers", choices=("device-like", "cpu"), default="device-like")
    p.add_argument("--slow-s", type=float, default=1.0, help="device-like: the slow teacher's s per 1,000 tokens")
    p.add_argument("--fast-s", type=float, default=0.5, help="device-like: the fast teacher's s per 1,000 tokens")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)

    from distill_common.models import load_causal_lm
    from student_trainer.config import TrainConfig
    from student_trainer.train import StudentMaps, TeacherPrefetcher, distill_step, open_teacher
    from student_trainer.teachers import TeacherSet
    from teacher_server.launcher import ServerProcess, child_env

    tmp = Path(tempfile.mkdtemp())
    device_like = args.teachers == "device-like"
    specs = {name: write_config(tmp / name, TINY if device_like and name != "student" else shape)
             for name, shape in SHAPES.items()}
    tokens = args.rows * args.seq
    servers = {}
    try:
        for name in ("slow", "fast"):
            delay = {"FORWARD_S_PER_KTOKEN": str(args.slow_s if name == "slow" else args.fast_s)} if device_like else {}
            servers[name] = ServerProcess("--model", specs[name], "--max-seq-len", str(args.seq),
                                          "--max-batch-tokens", str(tokens), startup_timeout_s=300,
                                          env=child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **delay),
                                          module="bench.device_like_teacher" if device_like else "teacher_server")
        kind = f",kind=topk,topk={args.topk}" if args.topk else ""

        def settings(names: tuple[str, ...]) -> TrainConfig:
            """The trainer's settings with teachers `names`."""
            return TrainConfig(model=specs["student"], data="synthetic", kd_weight=0.7, prefetch=args.prefetch,
                               seq_len=args.seq, batch_size=args.rows, teacher_timeout_s=600, log_level="WARNING",
                               teacher_spec=[f"name={name},address={servers[name].address}{kind}" for name in names])

        cfg = settings(("slow", "fast"))
        plans = {plan.name: plan for plan in cfg.teacher_plans}
        device = torch.device("cpu")
        model = load_causal_lm(specs["student"], device=device, dtype=torch.float32)
        model.train()
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        clients = {name: open_teacher(cfg, device, plans[name].outputs(), tokenizer=None, vocab_size=VOCAB,
                                      dataset=None, job_id=f"bench-{name}", rank=0, address=plans[name].address)
                   for name in plans}
        configurations = {"slow alone": ("slow",), "fast alone": ("fast",), "both": ("slow", "fast")}
        steps: dict[str, list[float]] = {label: [] for label in configurations}
        waits: dict[str, list[float]] = {label: [] for label in configurations}
        rounds: list[dict[str, float]] = []  # each round's median step per configuration
        seed = 0
        for _ in range(args.rounds):
            rounds.append({})
            for label, names in configurations.items():
                run_cfg = settings(names)
                teachers = TeacherSet(run_cfg.teacher_plans, [clients[name] for name in names])
                seed += 1
                prefetcher = TeacherPrefetcher(teachers, SyntheticBatches(args.rows, args.seq, seed), args.prefetch,
                                               600)
                for step in range(args.warmup + args.steps):
                    start = time.perf_counter()
                    record = distill_step(run_cfg, model, params, optimizer, scheduler, prefetcher, device, 1,
                                          contextlib.nullcontext(), StudentMaps(), None)
                    if step >= args.warmup:
                        steps[label].append(time.perf_counter() - start)
                        waits[label].append(record["teacher_wait_s"])
                prefetcher.drop_ahead()
                rounds[-1][label] = statistics.median(steps[label][-args.steps:])
        for client in clients.values():
            client.close(timeout_s=30)
    finally:
        for server in servers.values():
            server.stop()

    median = {label: statistics.median(times) for label, times in steps.items()}
    teachers = (f"device-like teachers, {args.slow_s:g} and {args.fast_s:g} s per 1,000 tokens" if device_like
                else "CPU teachers " + " and ".join(f"{SHAPES[n]['hidden_size']}x{SHAPES[n]['num_hidden_layers']}"
                                                    for n in ("slow", "fast")))
    lines = [f"Two teachers served at once against the slower alone ({teachers}; {os.cpu_count()} CPU cores; "
             f"{args.rows} x {args.seq} tokens a step, --prefetch {args.prefetch}, "
             f"{'top-' + str(args.topk) if args.topk else 'full logits'}, {args.rounds} rounds x {args.steps} steps)",
             "", "| configuration | median step s | mean step s | median teacher wait s | vs slow alone |",
             "|---|---:|---:|---:|---:|"]
    for label in configurations:
        lines.append(f"| {label} | {median[label]:.4f} | {statistics.mean(steps[label]):.4f} | "
                     f"{statistics.median(waits[label]):.4f} | {median[label] / median['slow alone']:.2f}x |")
    ratio = median["both"] / median["slow alone"]
    per_round = [r["both"] / r["slow alone"] for r in rounds]
    lines += ["", f"both / slow alone = {ratio:.3f} (bar: <= 1.1); median of the rounds' ratios "
              f"{statistics.median(per_round):.3f} (each round: {', '.join(f'{x:.2f}' for x in per_round)}); "
              f"(slow + fast) / slow alone = {(median['slow alone'] + median['fast alone']) / median['slow alone']:.3f} "
              "(what waiting for the sum would cost); load average at the end "
              f"{os.getloadavg()[0]:.1f}"]
    emit(lines, args.out, figures={"median_step_s": median, "ratio": ratio, "round_ratios": per_round,
                                   "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
