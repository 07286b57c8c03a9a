"""What each transport mode costs in quality (docs/training.md): the demo's students distilled from
the demo's teacher with its full logits, with its head applied on the student (final hidden state
sent), with its top 64 and its top 8 logits; two seeds each, and the same students with CE only.

    python -m bench.transport_quality [--out runs/transport_quality] [any flag of python -m distill_demo]

The data, the tokenizer and the trained teacher are the demo's, from its cache (trained first when
missing, as `make demo` does). Each mode's two seeds train at once against one teacher server, with
the demo's student settings (steps, batch, learning rate, kd-weight, temperature); the score is the
held-out cross-entropy per token at the last step. The seed fixes a student's initial weights and
its data order, so the modes differ only in what the teacher sends.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from distill_common.settings import settings_from, settings_parser
from distill_demo.config import QUICK, DemoConfig
from distill_demo.demo import ensure_teacher, prepare_data, save_random_llama, student_args
from distill_demo.processes import TeacherProcess, TrainerRun, wait_all

# (label, trainer flags, bytes per token the teacher sends in float32: f(vocab, hidden))
MODES = {
    "full": ("full logits", [], lambda vocab, hidden: 4 * vocab),
    "head": ("head on student", ["--head-on-student"], lambda vocab, hidden: 4 * hidden),
    "top64": ("top-64 logits", ["--topk", "64"], lambda vocab, hidden: 64 * (4 + 4)),
    "top8": ("top-8 logits", ["--topk", "8"], lambda vocab, hidden: 8 * (4 + 4)),
}


def main(argv: list[str] | None = None) -> int:
    parser = settings_parser(DemoConfig, prog="python -m bench.transport_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--no-ce", action="store_true", help="skip the CE-only students")
    parser.add_argument("--table", default="", help="also write the markdown table here")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    parser.set_defaults(output_dir="runs/transport_quality")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - MODES.keys())
    if unknown:
        parser.error(f"--modes: unknown {unknown}; use {', '.join(MODES)}")
    cfg = settings_from(DemoConfig, args)
    started = time.monotonic()
    out, cache = Path(cfg.output_dir), Path(cfg.cache_dir)
    data = prepare_data(cfg, cache)
    teacher = ensure_teacher(cfg, cache, data, out, threads=2)
    inits = {seed: out / "init" / f"student-seed{seed}" for seed in cfg.seeds}
    for seed, path in inits.items():
        save_random_llama(path, cfg.student, data, cfg.seq_len, seed)

    losses: dict[str, dict[int, float]] = {}
    with TeacherProcess(teacher.model_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        for mode in modes:
            label, flags, _ = MODES[mode]
            print(f"{label}: {len(cfg.seeds)} students at once, {cfg.student_steps} steps", flush=True)
            runs = [TrainerRun(f"{mode} seed {seed}", out / f"{mode}-seed{seed}",
                               [*student_args(cfg, data, inits[seed], seed), "--teacher", server.address,
                                "--kd-weight", str(cfg.kd_weight), "--temperature", str(cfg.temperature),
                                "--job-id", f"{mode}-seed{seed}", *flags], threads=1)
                    for seed in cfg.seeds]
            wait_all(runs, timeout_s=cfg.run_timeout_s)
            losses[mode] = {seed: run.final_eval_ce() for seed, run in zip(cfg.seeds, runs)}
    if not args.no_ce:
        print(f"CE only: {len(cfg.seeds)} students at once", flush=True)
        runs = [TrainerRun(f"ce seed {seed}", out / f"ce-seed{seed}",
                           [*student_args(cfg, data, inits[seed], seed), "--kd-weight", "0",
                            "--job-id", f"ce-seed{seed}"], threads=1) for seed in cfg.seeds]
        wait_all(runs, timeout_s=cfg.run_timeout_s)
        losses["ce"] = {seed: run.final_eval_ce() for seed, run in zip(cfg.seeds, runs)}

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(teacher.model_dir)
    table = render(losses, cfg.seeds, config.vocab_size, config.hidden_size, teacher.heldout_loss)
    print(f"\nheld-out loss (CE per token, nats) after {cfg.student_steps} steps, kd-weight {cfg.kd_weight}, "
          f"T {cfg.temperature}; {time.monotonic() - started:.0f} s\n\n{table}")
    (out / "results.json").write_text(json.dumps({"losses": losses, "teacher_loss": teacher.heldout_loss,
                                                  "vocab_size": config.vocab_size,
                                                  "hidden_size": config.hidden_size}, indent=2) + "\n")
    if args.table:
        Path(args.table).write_text(table + "\n")
    return 0


def render(losses: dict[str, dict[int, float]], seeds, vocab: int, hidden: int, teacher_loss: float) -> str:
    full = statistics.fmean(losses["full"].values()) if "full" in losses else math.nan
    rows = [["mode", "bytes/token", *[f"seed {s}" for s in seeds], "mean", "spread", "mean - full"]]
    for mode, by_seed in losses.items():
        label, _, size = MODES.get(mode, ("CE only (no teacher)", [], lambda v, h: 0))
        mean = statistics.fmean(by_seed.values())
        rows.append([label, f"{size(vocab, hidden):,}", *[f"{by_seed[s]:.4f}" for s in seeds], f"{mean:.4f}",
                     f"{max(by_seed.values()) - min(by_seed.values()):.4f}", f"{mean - full:+.4f}"])
    rows.append(["teacher", "-", *["-"] * len(seeds), f"{teacher_loss:.4f}", "-", "-"])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
