"""The demo, top to bottom: a real distillation on a CPU with nothing downloaded.

1. data     the stdlib corpus (train/held-out split by file) and a BPE tokenizer, cached
2. teacher  a small Llama trained with plain CE by the project's own trainer, cached
3. serve    `python -m teacher_server` on that teacher, on free loopback ports
4. distil   two KD students (two seeds) training at once against the one teacher
5. baseline the same two students with CE only: same init, data order and steps
then the held-out losses, whether KD beats CE by more than the spread over seeds,
and a plot of the loss curves.

Each student seed fixes both its initial weights (a saved random model) and its data
order (`--seed`), so a KD run and its CE twin differ only in the loss.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from distill_common.settings import non_defaults
from distill_demo.config import DemoConfig, ModelShape, settings_key
from distill_demo.processes import DemoError, TeacherProcess, TrainerRun, wait_all
from distill_demo.report import StudentResult, group, kd_beats_ce, loss_table, plot_curves

STEPS = 5
# Seconds between progress lines while children train.
PROGRESS_EVERY_S = 10.0
# The trained teacher must beat a uniform guess by at least this much (nats/token);
# otherwise it has learned next to nothing and distilling from it shows nothing.
MIN_TEACHER_GAIN = 0.5


def say(message: str = "") -> None:
    print(message, flush=True)


@dataclass
class DemoData:
    train: Path
    heldout: Path
    tokenizer_dir: Path
    vocab_size: int  # of the trained tokenizer (may be below the asked-for size on a tiny corpus)


@dataclass
class Teacher:
    model_dir: Path
    heldout_loss: float
    params: int
    cached: bool


@dataclass
class DemoResult:
    teacher_loss: float
    kd_loss: float
    ce_loss: float
    kd_beats_ce: bool
    plot: Path | None

    def result_line(self) -> str:
        return f"RESULT teacher_loss={self.teacher_loss:.4f} kd_loss={self.kd_loss:.4f} ce_loss={self.ce_loss:.4f}"


def run_demo(cfg: DemoConfig) -> DemoResult:
    started = time.monotonic()
    out, cache = Path(cfg.output_dir), Path(cfg.cache_dir)
    cores = os.cpu_count() or 1
    say(f"distill_demo: teacher-as-a-service on {cores} CPU core(s); output {out}, cache {cache}")
    say(f"settings (non-default): {non_defaults(cfg) or 'none'}")
    _quiet_transformers()

    data = prepare_data(cfg, cache)
    teacher = ensure_teacher(cfg, cache, data, out, threads=cores)
    # One random init per seed, shared by that seed's KD and CE student.
    inits = {seed: out / "init" / f"student-seed{seed}" for seed in cfg.seeds}
    student_params = [save_random_llama(path, cfg.student, data, cfg.seq_len, seed) for seed, path in inits.items()][0]

    say(f"\n[3/{STEPS}] serving the teacher: python -m teacher_server --model {teacher.model_dir}")
    # The teacher and two students share the cores: one thread each, so none waits on a
    # thread of its own that the others have preempted.
    with TeacherProcess(teacher.model_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        say(f"  READY: gRPC {server.address}, HTTP :{server.http_port} "
            f"(log: {server.log_path})")
        kd = distil(cfg, server, data, inits, out)
    ce = train_baselines(cfg, data, inits, out)

    results = kd + ce
    kd_stats, ce_stats = group(results, "kd"), group(results, "ce")
    holds = kd_beats_ce(kd_stats, ce_stats)
    say(f"\nheld-out loss: mean cross-entropy per token (nats) on {data.heldout}, "
        f"after {cfg.student_steps} student steps")
    say(loss_table(teacher_loss=teacher.heldout_loss, teacher_params=teacher.params, student_params=student_params,
                   results=results, seeds=cfg.seeds, uniform_loss=math.log(data.vocab_size)))
    say(f"\nKD - CE (means): {kd_stats.mean - ce_stats.mean:+.4f}. "
        f"KD beats CE beyond the spread over seeds (KD mean + spread < CE mean - spread: "
        f"{kd_stats.mean + kd_stats.spread:.4f} < {ce_stats.mean - ce_stats.spread:.4f}): "
        f"{'yes' if holds else 'NO'}")
    if cfg.quick and not holds:
        say("  (--quick trains a few steps only: it checks that the pipeline runs, not that KD wins)")

    title = (f"{cfg.student.hidden_size}-wide {cfg.student.num_layers}-layer student from a "
             f"{cfg.teacher.hidden_size}-wide {cfg.teacher.num_layers}-layer teacher: KD (alpha={cfg.kd_weight}, "
             f"T={cfg.temperature}) vs CE only")
    (out / "loss_curves.png").unlink(missing_ok=True)  # never leave an earlier run's plot behind
    plot = plot_curves(results, teacher.heldout_loss, out / "loss_curves.png", title)
    say(f"loss curves: {plot}" if plot else
        "loss curves: skipped, matplotlib is not installed (pip install 'teacher-service[plot]')")

    result = DemoResult(teacher.heldout_loss, kd_stats.mean, ce_stats.mean, holds, plot)
    summary = {"config": asdict(cfg), "teacher": {"model_dir": str(teacher.model_dir),
               "heldout_loss": teacher.heldout_loss, "params": teacher.params, "cached": teacher.cached},
               "students": [{"kind": r.kind, "seed": r.seed, "heldout_loss": r.heldout_loss, "wall_s": r.wall_s}
                            for r in results],
               "student_params": student_params, "kd_mean": kd_stats.mean, "kd_spread": kd_stats.spread,
               "ce_mean": ce_stats.mean, "ce_spread": ce_stats.spread, "kd_beats_ce": holds,
               "wall_s": time.monotonic() - started}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"results: {out / 'results.json'}; total {time.monotonic() - started:.0f} s")
    return result


# ---- 1. data -------------------------------------------------------------------------------


def prepare_data(cfg: DemoConfig, cache: Path) -> DemoData:
    from distill_demo.corpus import HELDOUT_FILENAME, TRAIN_FILENAME, write_jsonl_corpus
    from distill_demo.tokenizer import load_or_train_tokenizer

    data_dir = cache / f"data-{settings_key(cfg.data_settings())}"
    marker = data_dir / "settings.json"
    if marker.is_file():
        say(f"[1/{STEPS}] data: cached in {data_dir}")
    else:
        say(f"[1/{STEPS}] data: {cfg.max_files} stdlib files -> train/held-out JSONL, "
            f"{cfg.vocab_size}-token BPE tokenizer")
        # Built aside and renamed into place, so an interrupted build is never taken for a cached one.
        staging = _staging_dir(data_dir)
        try:
            train, _ = write_jsonl_corpus(staging, seq_chars=cfg.seq_chars, heldout_fraction=cfg.heldout_fraction,
                                          max_files=cfg.max_files, seed=cfg.split_seed)
            load_or_train_tokenizer(staging / "tokenizer", lambda: _texts(train), cfg.vocab_size)
            (staging / "settings.json").write_text(json.dumps(cfg.data_settings(), indent=2) + "\n")
            _publish(staging, data_dir, marker)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        say(f"  cached in {data_dir}")
    data = DemoData(data_dir / TRAIN_FILENAME, data_dir / HELDOUT_FILENAME, data_dir / "tokenizer", 0)
    data.vocab_size = len(load_or_train_tokenizer(data.tokenizer_dir, lambda: _texts(data.train), cfg.vocab_size))
    for split in (data.train, data.heldout):
        lines = sum(1 for _ in open(split))
        say(f"  {split.name}: {lines} chunks, {split.stat().st_size / 1e6:.2f} MB")
    return data


def _texts(path: Path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


# ---- 2. teacher ---------------------------------------------------------------------------


def ensure_teacher(cfg: DemoConfig, cache: Path, data: DemoData, out: Path, *, threads: int) -> Teacher:
    """The trained teacher from the cache, or trained now (plain CE) and cached.

    Its training log goes to the output directory, where it outlives a failed attempt.
    """
    teacher_dir = cache / f"teacher-{settings_key(cfg.teacher_settings())}"
    marker = teacher_dir / "teacher.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        say(f"\n[2/{STEPS}] teacher: cached in {teacher_dir} (held-out loss {info['heldout_loss']:.4f}); "
            f"delete that directory to train it again")
        return Teacher(teacher_dir / "model", info["heldout_loss"], info["params"], cached=True)

    shape = cfg.teacher
    say(f"\n[2/{STEPS}] teacher: training a {shape.hidden_size}-wide, {shape.num_layers}-layer Llama for "
        f"{cfg.teacher_steps} steps with plain CE (python -m student_trainer train --kd-weight 0)")
    staging = _staging_dir(teacher_dir)
    params = save_random_llama(staging / "init", shape, data, cfg.seq_len, seed=0)
    run = TrainerRun("teacher training", staging / "run", [
        "--model", str(staging / "init"), "--data", str(data.train), "--eval-data", str(data.heldout),
        "--eval-every", str(max(1, cfg.teacher_steps // 4)), "--max-steps", str(cfg.teacher_steps),
        "--batch-size", str(cfg.teacher_batch_size), "--seq-len", str(cfg.seq_len), "--lr", str(cfg.teacher_lr),
        "--warmup-steps", str(cfg.teacher_steps // 10), "--kd-weight", "0", "--seed", "0", "--job-id", "teacher",
    ], threads=threads, log_path=out / "teacher_train.log")
    progress = Progress([run], cfg.teacher_steps)
    try:
        wait_all([run], timeout_s=cfg.run_timeout_s, on_poll=progress.maybe_print)
        loss = run.final_eval_ce()
        uniform = math.log(data.vocab_size)
        if loss > uniform - MIN_TEACHER_GAIN:
            raise DemoError(f"the teacher's held-out loss {loss:.4f} is not clearly below a uniform guess "
                            f"({uniform:.4f}): it has not learned enough to teach. Raise --teacher-steps or "
                            f"--teacher-lr; its log is {run.log_path}")
        say(f"  trained in {run.wall_s:.0f} s: held-out loss {loss:.4f} (a uniform guess: {uniform:.4f})")
        # Keep the model and the record of its training; drop the optimizer checkpoints.
        shutil.move(str(run.run_dir / "model"), str(staging / "model"))
        shutil.move(str(run.run_dir / "metrics.jsonl"), str(staging / "metrics.jsonl"))
        shutil.copy(run.log_path, staging / "train.log")
        shutil.rmtree(run.run_dir)
        shutil.rmtree(staging / "init")
        marker_text = json.dumps({"settings": cfg.teacher_settings(), "heldout_loss": loss, "params": params,
                                  "train_s": run.wall_s}, indent=2)
        (staging / "teacher.json").write_text(marker_text + "\n")
        _publish(staging, teacher_dir, marker)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"  cached in {teacher_dir}")
    return Teacher(teacher_dir / "model", loss, params, cached=False)


def save_random_llama(out_dir: Path, shape: ModelShape, data: DemoData, seq_len: int, seed: int) -> int:
    """Saves a Llama of `shape` with random weights fixed by `seed`, and the demo's tokenizer, to
    `out_dir`; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(data.tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads, max_position_embeddings=seq_len,
        # Tied input/output embeddings: at this size the embeddings are most of the parameters.
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


# ---- 4. distil, 5. baseline ------------------------------------------------------------------


def student_args(cfg: DemoConfig, data: DemoData, init_dir: Path, seed: int) -> list[str]:
    """The trainer flags every student shares, KD or CE: same init, data, order, steps, schedule."""
    return ["--model", str(init_dir), "--data", str(data.train), "--eval-data", str(data.heldout),
            "--eval-every", str(cfg.eval_every), "--max-steps", str(cfg.student_steps),
            "--batch-size", str(cfg.student_batch_size), "--seq-len", str(cfg.seq_len), "--lr", str(cfg.student_lr),
            "--warmup-steps", str(cfg.student_steps // 10), "--seed", str(seed)]


def distil(cfg: DemoConfig, server: TeacherProcess, data: DemoData, inits: dict[int, Path],
           out: Path) -> list[StudentResult]:
    say(f"\n[4/{STEPS}] distilling: {len(cfg.seeds)} KD students (seeds {_seeds(cfg)}) training at the same time "
        f"against the one teacher, {cfg.student_steps} steps each, kd-weight {cfg.kd_weight}, "
        f"temperature {cfg.temperature}")
    runs = [TrainerRun(f"KD student seed {seed}", out / f"kd-seed{seed}",
                       [*student_args(cfg, data, inits[seed], seed), "--teacher", server.address,
                        "--kd-weight", str(cfg.kd_weight), "--temperature", str(cfg.temperature),
                        "--job-id", f"kd-seed{seed}"], threads=1)
            for seed in cfg.seeds]
    sessions: dict[str, dict] = {}  # job id -> the last status seen of its session
    most_at_once = 0
    progress = Progress(runs, cfg.student_steps)

    def watch() -> None:
        nonlocal most_at_once
        server.check_alive()
        ready = [s for s in server.status()["sessions"] if s["state"] in ("ready", "draining")]
        most_at_once = max(most_at_once, len(ready))
        for session in ready:
            sessions[session["job_id"]] = session
        progress.maybe_print()

    # Polled often: a session leaves the status page when it ends, and its last counters go with it.
    wait_all(runs, timeout_s=cfg.run_timeout_s, on_poll=watch, poll_s=0.25)
    overlap = (f"{most_at_once} sessions served at the same time" if most_at_once > 1 else
               "the sessions did not overlap (one ended before the other joined)")
    say(f"  one teacher, {overlap}; what each student received (as of the teacher's last status):")
    for seed, run in zip(cfg.seeds, runs):
        metrics = run.metrics()
        wait_s = sum(m.get("teacher_wait_s", 0.0) for m in metrics)
        seen = sessions.get(f"kd-seed{seed}")
        served = (f"session {seen['session_id']}: >= {seen['batches_sent']} batches, "
                  f"{seen['tokens_served'] / 1e3:.0f}k tokens, {seen['bytes_sent'] / 1e9:.2f} GB of logits"
                  if seen else "session not seen by the status poll (it ran for less than a poll)")
        say(f"  - KD seed {seed}: {len(metrics)} steps in {run.wall_s:.0f} s; {served}; waited {wait_s:.1f} s "
            f"for the teacher in all ({1e3 * wait_s / max(1, len(metrics)):.0f} ms/step)")
    return [_result("kd", seed, run) for seed, run in zip(cfg.seeds, runs)]


def train_baselines(cfg: DemoConfig, data: DemoData, inits: dict[int, Path], out: Path) -> list[StudentResult]:
    say(f"\n[5/{STEPS}] baseline: the same students (seeds {_seeds(cfg)}, same init and data order) with "
        f"plain CE, no teacher, {cfg.student_steps} steps")
    runs = [TrainerRun(f"CE student seed {seed}", out / f"ce-seed{seed}",
                       [*student_args(cfg, data, inits[seed], seed), "--kd-weight", "0",
                        "--job-id", f"ce-seed{seed}"], threads=1)
            for seed in cfg.seeds]
    wait_all(runs, timeout_s=cfg.run_timeout_s, on_poll=Progress(runs, cfg.student_steps).maybe_print)
    return [_result("ce", seed, run) for seed, run in zip(cfg.seeds, runs)]


def _result(kind: str, seed: int, run: TrainerRun) -> StudentResult:
    return StudentResult(kind, seed, run.final_eval_ce(), run.wall_s, run.metrics())


class Progress:
    """A line per PROGRESS_EVERY_S with each run's step and latest losses."""

    def __init__(self, runs: list[TrainerRun], total_steps: int):
        self.runs, self.total_steps = runs, total_steps
        self._last = time.monotonic()

    def maybe_print(self) -> None:
        if time.monotonic() - self._last < PROGRESS_EVERY_S:
            return
        self._last = time.monotonic()
        parts = []
        for run in self.runs:
            metrics = run.metrics()
            if not metrics:
                parts.append(f"{run.name}: starting")
                continue
            evals = [m["eval_ce"] for m in metrics if "eval_ce" in m]
            held_out = f", held-out {evals[-1]:.3f}" if evals else ""
            parts.append(f"{run.name}: step {metrics[-1]['step']}/{self.total_steps}, "
                         f"loss {metrics[-1]['loss']:.3f}{held_out}")
        say(f"  [{self.runs[0].wall_s:4.0f} s] " + " | ".join(parts))


# ---- helpers -------------------------------------------------------------------------------------


def _staging_dir(final: Path) -> Path:
    staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, final: Path, marker: Path) -> None:
    """Renames a finished build into its cache place; another process's finished build wins."""
    try:
        os.rename(staging, final)
    except OSError as e:
        if not marker.is_file():
            raise DemoError(f"could not move {staging} to {final} ({e}); delete {final} and run again") from e
        shutil.rmtree(staging, ignore_errors=True)


def _seeds(cfg: DemoConfig) -> str:
    return ", ".join(map(str, cfg.seeds))


def _quiet_transformers() -> None:
    """No per-shard progress bars when the demo saves its small random models."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

