"""What each transport mode costs in quality (docs/training.md): the demo's students distilled from
the demo's teacher with its full logits, with its head applied on the student (final hidden state
sent), and with its top k (64, 16, 8) log-probabilities, the rest of its mass kept as one outcome
(the default) or, as the renormalised loss does, dropped; two seeds each, and the same students
with CE only.

    python -m bench.transport_quality [--output-dir runs/transport_quality] [--modes ...]
                                      [any flag of python -m distill_demo]

The data, the tokenizer and the trained teacher are the demo's, from its cache (trained first when
missing, as `make demo` does). Each mode's two seeds train at once against one teacher server, with
the demo's student settings (steps, batch, learning rate, kd-weight, temperature); the score is the
held-out cross-entropy per token at the last step, and the share of full-logit KD's gain over CE
only that a mode keeps. The seed fixes a student's initial weights and its data order, so the modes
differ only in what the teacher sends and how the loss reads it.
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

# Bytes per token the teacher sends for a vocabulary of V and a hidden size of H, with values of
# `value_bytes` each (the demo's teacher runs in float32: 4; a bfloat16 teacher or a store: 2).
def _logits(value_bytes: int, vocab: int, hidden: int) -> int:
    return value_bytes * vocab


def _head(value_bytes: int, vocab: int, hidden: int) -> int:
    return value_bytes * hidden


def _topk(k: int):
    return lambda value_bytes, vocab, hidden: k * (value_bytes + 4)  # values + int32 ids


# mode -> (label, trainer flags, bytes per token, the value size it is sent with (None: the teacher's))
MODES = {
    "full": ("full logits", [], _logits, None),
    "head": ("head on student", ["--head-on-student"], _head, None),
    "top64": ("top-64, renormalised", ["--topk", "64", "--topk-tail", "none"], _topk(64), None),
    "top8": ("top-8, renormalised", ["--topk", "8", "--topk-tail", "none"], _topk(8), None),
    "top64-tail": ("top-64 + tail", ["--topk", "64"], _topk(64), None),
    "top16-tail": ("top-16 + tail", ["--topk", "16"], _topk(16), None),
    "top8-tail": ("top-8 + tail", ["--topk", "8"], _topk(8), None),
    "top64-tail-bf16": ("top-64 + tail, bf16 values", ["--topk", "64", "--teacher-dtype", "bfloat16"], _topk(64), 2),
}
DEFAULT_MODES = ("full", "top64-tail", "top64", "top16-tail", "top8-tail", "top8", "top64-tail-bf16", "head")


def main(argv: list[str] | None = None) -> int:
    parser = settings_parser(DemoConfig, prog="python -m bench.transport_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(teacher.model_dir)

    def save() -> None:  # after every phase: a long run stopped early keeps what it measured
        (out / "results.json").write_text(json.dumps({"losses": losses, "teacher_loss": teacher.heldout_loss,
                                                      "vocab_size": config.vocab_size,
                                                      "hidden_size": config.hidden_size}, indent=2) + "\n")

    if not args.no_ce:  # first: every mode's share of KD's gain is measured against it
        print(f"CE only: {len(cfg.seeds)} students at once", flush=True)
        runs = [TrainerRun(f"ce seed {seed}", out / f"ce-seed{seed}",
                           [*student_args(cfg, data, inits[seed], seed), "--kd-weight", "0",
                            "--job-id", f"ce-seed{seed}"], threads=1) for seed in cfg.seeds]
        wait_all(runs, timeout_s=cfg.run_timeout_s)
        losses["ce"] = {seed: run.final_eval_ce() for seed, run in zip(cfg.seeds, runs)}
        save()
    with TeacherProcess(teacher.model_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        for mode in modes:
            label, flags, _, _ = MODES[mode]
            print(f"{label}: {len(cfg.seeds)} students at once, {cfg.student_steps} steps", flush=True)
            runs = [TrainerRun(f"{mode} seed {seed}", out / f"{mode}-seed{seed}",
                               [*student_args(cfg, data, inits[seed], seed), "--teacher", server.address,
                                "--kd-weight", str(cfg.kd_weight), "--temperature", str(cfg.temperature),
                                "--job-id", f"{mode}-seed{seed}", *flags], threads=1)
                    for seed in cfg.seeds]
            wait_all(runs, timeout_s=cfg.run_timeout_s)
            losses[mode] = {seed: run.final_eval_ce() for seed, run in zip(cfg.seeds, runs)}
            save()
    if "ce" in losses:  # listed last
        losses["ce"] = losses.pop("ce")
        save()

    table = render(losses, cfg.seeds, config.vocab_size, config.hidden_size, teacher.heldout_loss)
    print(f"\nheld-out loss (CE per token, nats) after {cfg.student_steps} steps, kd-weight {cfg.kd_weight}, "
          f"T {cfg.temperature}; {time.monotonic() - started:.0f} s\n\n{table}")
    if args.table:
        Path(args.table).write_text(table + "\n")
    return 0


def render(losses: dict[str, dict[int, float]], seeds, vocab: int, hidden: int, teacher_loss: float,
           teacher_bytes: int = 4) -> str:
    """The table: per mode its bytes per token (as sent by a teacher of `teacher_bytes` per value,
    and with 16-bit values), the held-out loss per seed, and the share of full-logit KD's gain over
    CE only that it keeps."""
    full = statistics.fmean(losses["full"].values()) if "full" in losses else math.nan
    ce = statistics.fmean(losses["ce"].values()) if "ce" in losses else math.nan
    rows = [["mode", "bytes/token sent", "in 16 bits", *[f"seed {s}" for s in seeds], "mean", "spread",
             "mean - full", "share of KD's gain"]]
    for mode, by_seed in losses.items():
        label, _, size, sent_bytes = MODES.get(mode, ("CE only (no teacher)", [], lambda *_: 0, None))
        mean = statistics.fmean(by_seed.values())
        share = (ce - mean) / (ce - full) if mode != "ce" else 0.0
        rows.append([label, f"{size(sent_bytes or teacher_bytes, vocab, hidden):,}", f"{size(2, vocab, hidden):,}",
                     *[f"{by_seed[s]:.4f}" for s in seeds], f"{mean:.4f}",
                     f"{max(by_seed.values()) - min(by_seed.values()):.4f}", f"{mean - full:+.4f}",
                     "-" if math.isnan(share) else f"{100 * share:.1f}%"])
    rows.append(["teacher", "-", "-", *["-"] * len(seeds), f"{teacher_loss:.4f}", "-", "-", "-"])
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
