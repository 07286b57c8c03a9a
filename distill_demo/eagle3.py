"""`python -m distill_demo.eagle3` (`make demo-eagle3`): an EAGLE-3 draft for the demo's teacher.

1. data     the demo's corpus and tokenizer (distill_demo/demo.py, the same cache as `make demo`)
2. teacher  the demo's teacher, trained and cached as `make demo` does it
3. serve    `python -m teacher_server` on the teacher
4. draft    `python -m student_trainer eagle3` trains a draft from it (the teacher sends three
            layers' states and its logits over the draft's vocabulary)
5. accept   the served teacher decodes held-out source greedily and verifies the draft's
            proposals: tokens per teacher forward with the draft, beside 1.0 without it

The last line printed is `RESULT acceptance_length=... baseline=1.00`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distill_common.settings import ConfigError, IntTuple, flag, non_defaults
from distill_demo.config import DemoConfig
from distill_demo.demo import Progress, ensure_teacher, prepare_data, say
from distill_demo.processes import TeacherProcess, TrainerRun, run_command, wait_all

STEPS = 5  # as `make demo` numbers its first two, shared, steps
# Steps at the end of training whose per-step accuracies are averaged for the report.
LAST_STEPS = 20


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class Eagle3DemoConfig:
    output_dir: str = field(default="runs/demo-eagle3", metadata=_help(
        "the draft's run (metrics.jsonl, draft/), logs and results.json"))
    cache_dir: str = field(default=".cache/distill_demo", metadata=_help(
        "corpus, tokenizer and trained teacher, shared with `make demo`"))
    draft_steps: int = field(default=300, metadata=_help("draft training steps"))
    draft_lr: float = field(default=3e-3, metadata=_help("draft learning rate"))
    draft_batch_size: int = field(default=8, metadata=_help("sequences per draft training step"))
    ttt_steps: int = field(default=4, metadata=_help(
        "K: steps of the training-time test, and proposals per teacher forward when evaluating"))
    draft_vocab_size: int = field(default=512, metadata=_help("the draft's vocabulary (the teacher has 1024 ids)"))
    aux_layers: IntTuple = field(default=(0, 1, 2), metadata=_help(
        "the teacher's layers the draft reads: its embeddings, after layer 1 and after its final norm (the "
        "reference default, 2, L//2, L-3, needs 7 layers; this teacher has 2)"))
    prompts: int = field(default=16, metadata=_help("held-out prompts decoded"))
    prompt_tokens: int = field(default=64, metadata=_help("tokens of each prompt"))
    new_tokens: int = field(default=48, metadata=_help("tokens generated after each prompt"))
    startup_timeout_s: float = field(default=120.0, metadata=_help("how long to wait for the teacher server's READY"))
    run_timeout_s: float = field(default=1800.0, metadata=_help("how long the teacher's or the draft's training may "
                                                                "take"))

    def __post_init__(self) -> None:
        self.aux_layers = IntTuple(self.aux_layers)
        for name in ("draft_steps", "draft_batch_size", "ttt_steps", "draft_vocab_size", "prompts", "prompt_tokens",
                     "new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if len(self.aux_layers) != 3:
            raise ConfigError("--aux-layers: name three of the teacher's layers, e.g. 0,1,2")

    def base(self) -> DemoConfig:
        """The data and teacher settings of `make demo` (its defaults), in this demo's directories."""
        return DemoConfig(output_dir=self.output_dir, cache_dir=self.cache_dir, run_timeout_s=self.run_timeout_s,
                          startup_timeout_s=self.startup_timeout_s)


@dataclass
class Eagle3DemoResult:
    acceptance_length: float
    rates: list[float]
    accuracies: list[float]  # per unroll step, at the end of training

    def result_line(self) -> str:
        return f"RESULT acceptance_length={self.acceptance_length:.2f} baseline=1.00"


def run_eagle3_demo(cfg: Eagle3DemoConfig) -> Eagle3DemoResult:
    from student_trainer.eagle3.config import Eagle3EvalConfig
    from student_trainer.eagle3.evaluate import evaluate_acceptance

    started = time.monotonic()
    out = Path(cfg.output_dir)
    base = cfg.base()
    say(f"distill_demo.eagle3: an EAGLE-3 draft for the demo's teacher; output {out}, cache {cfg.cache_dir}")
    say(f"settings (non-default): {non_defaults(cfg) or 'none'}")
    data = prepare_data(base, Path(cfg.cache_dir))
    teacher = ensure_teacher(base, Path(cfg.cache_dir), data, out, threads=os.cpu_count() or 1)

    say(f"\n[3/{STEPS}] serving the teacher: python -m teacher_server --model {teacher.model_dir}")
    run_dir = out / "draft-run"
    with TeacherProcess(teacher.model_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        say(f"  READY: gRPC {server.address} (log: {server.log_path})")
        say(f"\n[4/{STEPS}] draft: python -m student_trainer eagle3, a {cfg.ttt_steps}-step draft over the "
            f"{cfg.draft_vocab_size} most frequent tokens, {cfg.draft_steps} steps")
        run = TrainerRun("EAGLE-3 draft", run_dir, [
            "--teacher", server.address, "--target-model", str(teacher.model_dir), "--data", str(data.train),
            "--max-steps", str(cfg.draft_steps), "--batch-size", str(cfg.draft_batch_size),
            "--seq-len", str(base.seq_len), "--ttt-steps", str(cfg.ttt_steps),
            "--draft-vocab-size", str(cfg.draft_vocab_size), "--aux-layers", ",".join(map(str, cfg.aux_layers)),
            "--lr", str(cfg.draft_lr), "--warmup-steps", str(cfg.draft_steps // 20), "--max-grad-norm", "1.0",
            "--export-dtype", "float32", "--job-id", "eagle3-demo"], threads=1, command="eagle3")
        wait_all([run], timeout_s=cfg.run_timeout_s, on_poll=Progress([run], cfg.draft_steps).maybe_print)
        metrics = run.metrics()
        accuracies = [statistics.fmean(m[f"acc_{k}"] for m in metrics[-LAST_STEPS:]) for k in range(cfg.ttt_steps)]
        say(f"  trained in {run.wall_s:.0f} s; accuracy per unroll step (mean of the last {LAST_STEPS} steps): "
            + ", ".join(f"step {k + 1} {acc:.3f}" for k, acc in enumerate(accuracies)))

        say(f"\n[5/{STEPS}] acceptance: the teacher decodes {cfg.prompts} held-out prompts greedily "
            f"({cfg.prompt_tokens} tokens each, {cfg.new_tokens} new), verifying {cfg.ttt_steps} proposals "
            "per forward")
        acceptance = evaluate_acceptance(Eagle3EvalConfig(
            teacher=server.address, draft=str(run_dir / "draft"), data=str(data.heldout), steps=cfg.ttt_steps,
            prompts=cfg.prompts, prompt_tokens=cfg.prompt_tokens, new_tokens=cfg.new_tokens, device="cpu",
            output=str(out / "acceptance.json")))

    say(f"\nheld-out acceptance on {data.heldout} ({acceptance.rounds} verifying forwards):")
    say(f"  {'decoding':<26}{'tokens per teacher forward':>28}")
    say(f"  {'teacher alone':<26}{1.0:>28.2f}")
    say(f"  {'teacher + EAGLE-3 draft':<26}{acceptance.mean_acceptance_length:>28.2f}")
    say("  acceptance rate by position: "
        + "  ".join(f"{i + 1}: {rate:.3f}" for i, rate in enumerate(acceptance.rates)))
    result = Eagle3DemoResult(acceptance.mean_acceptance_length, acceptance.rates, accuracies)
    (out / "results.json").write_text(json.dumps({
        "settings": non_defaults(cfg), "teacher": str(teacher.model_dir), "acceptance_length": result.acceptance_length,
        "rates": result.rates, "accuracies": accuracies, "draft_train_s": run.wall_s,
        "wall_s": time.monotonic() - started}, indent=2) + "\n")
    say(f"results: {out / 'results.json'}; total {time.monotonic() - started:.0f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    from distill_demo.config import parse_settings

    config = parse_settings(Eagle3DemoConfig, argv, "python -m distill_demo.eagle3",
                            "Train an EAGLE-3 draft for the demo's teacher from the served teacher, and report its "
                            "acceptance length on held-out source. CPU only, no downloads.")
    return run_command("distill_demo.eagle3", lambda: run_eagle3_demo(config))


if __name__ == "__main__":
    sys.exit(main())
