"""On-policy distillation against the alternatives, at equal student steps, on a task built here.

    python -m distill_demo.onpolicy_compare [--quick] [--seeds 0,1,2] [--output-dir runs/onpolicy]

The task (distill_demo/arithmetic.py): sums of two numbers, scored by exact match. The student's
dataset is what a careless solver wrote: it drops the carry out of the units digit (with
probability --slip; 1, the default, makes it a systematic mistake, which a student learns as
readily as the right rule), so the answers of nearly half its problems are wrong, while the
teacher, trained on its own right answers, solves better. That is the situation distillation is
for: the data alone teaches the student less than the teacher can.

1. data      three disjoint sets of problems: the teacher's (right answers), the students'
             dataset (the careless answers), held-out (right answers)
2. teacher   a Llama trained with CE on its problems by the project's trainer, cached
3. students  per seed, a smaller Llama warmed up with CE on the dataset (cached), so that its
             samples are worth scoring: every arm of that seed starts from it
4. arms      from each seed's warm student, --steps steps each, --parallel at a time, all against
             one served teacher (python -m teacher_server):
               no distillation      CE on the dataset's completions
               off-policy KD        forward KL to the teacher's full logits, on the dataset's completions
               on-policy            reverse KL on the student's own samples, on its top --student-topk ids
                                    and the rest, which the teacher scores exactly (ScoredLogprobs)
               mixture              the same with λ = 0.5: half the batches keep the dataset's completions
               on-policy, sampled   the per-token reverse KL on the sampled tokens alone (NextTokenLogprobs)
5. report    held-out exact match (greedy, the trainer's eval), the teacher's log-likelihood per token
             of each student's samples (temperature 1, scored by the served teacher); a table,
             results.json and onpolicy.png in --output-dir; whether on-policy beats no distillation
             by more than the spread over seeds.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distill_common.settings import ConfigError, IntTuple, flag, non_defaults
from distill_demo.config import ModelShape, settings_key
from distill_demo.demo import say

STEPS = 5
# name, label, trainer flags (beyond the shared ones); the teacher is passed to all but the first.
ARMS = (
    ("none", "no distillation", ["--kd-weight", "0", "--on-policy-fraction", "0"]),
    ("offpolicy", "off-policy KD", ["--kd-weight", "1", "--on-policy-fraction", "0", "--loss", "forward_kl"]),
    ("onpolicy", "on-policy", ["--kd-weight", "1", "--on-policy-fraction", "1", "--on-policy-loss", "divergence",
                               "--loss", "reverse_kl"]),
    ("mixture", "mixture λ=0.5", ["--kd-weight", "1", "--on-policy-fraction", "0.5", "--on-policy-loss",
                                  "divergence", "--loss", "reverse_kl"]),
    ("sampled", "on-policy, sampled tokens", ["--kd-weight", "1", "--on-policy-fraction", "1", "--on-policy-loss",
                                              "sampled"]),
)
TOPK_ARMS = ("onpolicy", "mixture")  # also given --student-topk

TEACHER = ModelShape(hidden_size=96, num_layers=2, intermediate_size=384, num_heads=4)
STUDENT = ModelShape(hidden_size=64, num_layers=2, intermediate_size=256, num_heads=4)
QUICK_TEACHER = ModelShape(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2)
QUICK_STUDENT = ModelShape(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2)
# --quick: tiny everything; checks that the pipeline runs, not which arm wins.
QUICK = dict(teacher_problems=400, student_problems=200, heldout_problems=40, teacher_steps=30, warmup_steps=10,
             steps=6, eval_every=3, seeds=(0, 1), batch_size=8, teacher_batch_size=8, parallel=3)


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class CompareConfig:
    output_dir: str = field(default="runs/onpolicy", metadata=_help("runs, results.json and onpolicy.png"))
    cache_dir: str = field(default=".cache/onpolicy", metadata=_help("the trained teacher and warm students"))
    quick: bool = field(default=False, metadata=_help(
        "tiny models and few steps: checks the pipeline only (flags given explicitly override its values)"))
    digits: int = field(default=2, metadata=_help("the numbers added have up to this many digits"))
    teacher_problems: int = field(default=5000, metadata=_help("problems the teacher is trained on"))
    student_problems: int = field(default=3000, metadata=_help("problems in the students' dataset"))
    heldout_problems: int = field(default=500, metadata=_help("held-out problems"))
    slip: float = field(default=1.0, metadata=_help(
        "the dataset's solver drops the carry out of the units digit with this probability"))
    teacher_steps: int = field(default=1500, metadata=_help("teacher training steps"))
    teacher_lr: float = field(default=3e-3, metadata=_help("teacher learning rate"))
    teacher_batch_size: int = field(default=64, metadata=_help("teacher training batch size"))
    warmup_steps: int = field(default=3000, metadata=_help("steps of CE that warm each student up"))
    warmup_lr: float = field(default=3e-3, metadata=_help("the warm-up's learning rate"))
    steps: int = field(default=400, metadata=_help("steps of every arm"))
    lr: float = field(default=1e-3, metadata=_help("the arms' learning rate (decayed linearly to 0)"))
    batch_size: int = field(default=32, metadata=_help("sequences per step, warm-up and arms alike"))
    student_topk: int = field(default=4, metadata=_help("ids of the student the teacher scores (on-policy, mixture)"))
    seeds: IntTuple = field(default=(0, 1, 2), metadata=_help("student seeds: init, data order and sampling"))
    eval_every: int = field(default=50, metadata=_help("steps between held-out evaluations"))
    parallel: int = field(default=2, metadata=_help("arms training at once against the teacher"))
    startup_timeout_s: float = field(default=180.0, metadata=_help("wait for the teacher server's READY"))
    run_timeout_s: float = field(default=1800.0, metadata=_help("how long one training phase may take"))
    teacher: ModelShape = field(init=False)
    student: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        self.seeds = IntTuple(self.seeds)
        self.teacher = QUICK_TEACHER if self.quick else TEACHER
        self.student = QUICK_STUDENT if self.quick else STUDENT
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("--seeds: give at least two different seeds (the spread over seeds is the yardstick)")
        for name in ("digits", "teacher_problems", "student_problems", "heldout_problems", "teacher_steps",
                     "teacher_batch_size",
                     "warmup_steps", "steps", "batch_size", "student_topk", "eval_every", "parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if not 0 <= self.slip <= 1:
            raise ConfigError(f"--slip {self.slip} must lie in [0, 1]")
        total = self.teacher_problems + self.student_problems + self.heldout_problems
        if total > 0.9 * 10 ** (2 * self.digits):
            raise ConfigError(f"{total} problems do not fit in the {10 ** (2 * self.digits)} sums of "
                              f"{self.digits}-digit numbers: ask for fewer, or raise --digits")

    @property
    def seq_len(self) -> int:
        return 2 * self.digits + 2 + self.digits + 2  # "a+b=" then the answer (one digit more) and eos

    def data_settings(self) -> dict:
        return {key: getattr(self, key) for key in ("digits", "teacher_problems", "student_problems",
                                                     "heldout_problems", "slip")}

    def teacher_settings(self) -> dict:
        """What the teacher depends on: its problems and the held-out ones it is scored on (not --slip)."""
        problems = {key: value for key, value in self.data_settings().items() if key != "slip"}
        return {"problems": problems, "shape": dataclasses.asdict(self.teacher), "steps": self.teacher_steps,
                "lr": self.teacher_lr, "batch_size": self.teacher_batch_size}

    def warmup_settings(self, seed: int) -> dict:
        return {"data": self.data_settings(), "shape": dataclasses.asdict(self.student), "steps": self.warmup_steps,
                "lr": self.warmup_lr, "batch_size": self.batch_size, "seed": seed, "schedule": "cosine"}


# ---- 1. data ----------------------------------------------------------------------------------


@dataclass
class Data:
    directory: Path
    teacher: Path
    students: Path
    heldout: Path
    dataset_right: float  # the share of the students' dataset whose answer is right


def prepare_data(cfg: CompareConfig, cache: Path) -> Data:
    from distill_demo.arithmetic import careless_answer, make_tokenizer, problems, write_jsonl

    directory = cache / f"data-{settings_key(cfg.data_settings())}"
    directory.mkdir(parents=True, exist_ok=True)
    pairs = problems(cfg.teacher_problems + cfg.student_problems + cfg.heldout_problems, seed=0, digits=cfg.digits)
    teacher = pairs[:cfg.teacher_problems]
    students = pairs[cfg.teacher_problems:cfg.teacher_problems + cfg.student_problems]
    heldout = pairs[cfg.teacher_problems + cfg.student_problems:]
    rng = random.Random(1)
    careless = [(prompt, careless_answer(prompt, rng, cfg.slip)) for prompt, _ in students]
    data = Data(directory, write_jsonl(directory / "teacher.jsonl", teacher),
                write_jsonl(directory / "students.jsonl", careless), write_jsonl(directory / "heldout.jsonl", heldout),
                statistics.fmean(given == right for (_, given), (_, right) in zip(careless, students)))
    make_tokenizer(directory / "tokenizer")
    say(f"[1/{STEPS}] data in {directory}: {len(teacher)} teacher problems, {len(careless)} in the students' "
        f"dataset ({data.dataset_right:.0%} of its answers right: the units' carry dropped with p={cfg.slip}), "
        f"{len(heldout)} held out")
    return data


# ---- 2. teacher, 3. warm students -----------------------------------------------------------------


def save_llama(path: Path, shape: ModelShape, data: Data, seed: int) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(data.directory / "tokenizer")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_heads,
                         max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def common_args(cfg: CompareConfig, data: Data, model: Path, seed: int, batch_size: int = 0) -> list[str]:
    return ["--model", str(model), "--eval-data", str(data.heldout), "--batch-size", str(batch_size or cfg.batch_size),
            "--seq-len", str(cfg.seq_len), "--max-new-tokens", str(cfg.digits + 2), "--seed", str(seed),
            "--log-every", "1"]


@dataclass
class Trained:
    """A model trained with CE, cached by its settings."""

    name: str
    settings: dict
    shape: ModelShape
    init_seed: int
    args: list[str]  # trainer flags besides the shared ones
    steps: int
    batch_size: int
    model_dir: Path | None = None
    exact_match: float = float("nan")  # held-out, at the last step
    params: int = 0


def ensure_trained(cfg: CompareConfig, jobs: list[Trained], data: Data, cache: Path, out: Path) -> None:
    """Fills each job's model_dir, exact_match and params: from the cache, or trained now
    (--parallel at a time) and cached."""
    from distill_demo.processes import DemoError, TrainerRun, wait_all

    missing = []
    for job in jobs:
        directory = cache / f"{job.name}-{settings_key(job.settings)}"
        if (directory / "trained.json").is_file():
            info = json.loads((directory / "trained.json").read_text())
            job.model_dir, job.exact_match, job.params = directory / "model", info["exact_match"], info["params"]
        else:
            missing.append((job, directory))
    for start in range(0, len(missing), cfg.parallel):
        wave = missing[start:start + cfg.parallel]
        runs = []
        for job, directory in wave:
            staging = directory.parent / f".{directory.name}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            job.params = save_llama(staging / "init", job.shape, data, job.init_seed)
            runs.append(TrainerRun(job.name, staging / "run", [
                *common_args(cfg, data, staging / "init", job.init_seed, job.batch_size), *job.args,
                "--max-steps", str(job.steps), "--eval-every", str(job.steps)],
                threads=1, log_path=out / f"{job.name}.log"))
        wait_all(runs, timeout_s=cfg.run_timeout_s)
        for (job, directory), run in zip(wave, runs):
            evals = [m for m in run.metrics() if "eval_exact_match" in m]
            if not evals:
                raise DemoError(f"{job.name} wrote no held-out evaluation; see {run.log_path}")
            staging = run.run_dir.parent
            shutil.move(str(run.run_dir / "model"), str(staging / "model"))
            shutil.rmtree(run.run_dir)
            shutil.rmtree(staging / "init")
            job.exact_match = evals[-1]["eval_exact_match"]
            (staging / "trained.json").write_text(json.dumps({"exact_match": job.exact_match, "params": job.params,
                                                              "settings": job.settings, "wall_s": run.wall_s}) + "\n")
            shutil.rmtree(directory, ignore_errors=True)
            staging.rename(directory)
            job.model_dir = directory / "model"


# ---- 4. arms ------------------------------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: str
    seed: int
    exact_match: float  # held-out, greedy, at the last step
    curve: list[tuple[int, float]]  # (step, held-out exact match)
    teacher_loglik: float = float("nan")  # per token, of the student's samples at temperature 1
    wall_s: float = 0.0


def run_arms(cfg: CompareConfig, data: Data, warm: dict[int, Path], warm_match: dict[int, float], server,
             out: Path) -> list[ArmResult]:
    from distill_demo.processes import TrainerRun, wait_all

    pending = [(name, flags, seed) for seed in cfg.seeds for name, _, flags in ARMS]
    results = []
    most_at_once = 0
    while pending:
        wave, pending = pending[:cfg.parallel], pending[cfg.parallel:]
        runs = []
        for name, flags, seed in wave:
            args = [*common_args(cfg, data, warm[seed], seed), "--data", str(data.students), *flags,
                    "--max-steps", str(cfg.steps), "--eval-every", str(cfg.eval_every), "--lr", str(cfg.lr),
                    "--schedule", "linear",
                    "--job-id", f"{name}-seed{seed}"]
            if name != "none":
                args += ["--teacher", server.address]
            if name in TOPK_ARMS:
                args += ["--student-topk", str(cfg.student_topk)]
            runs.append(TrainerRun(f"{name} seed {seed}", out / f"{name}-seed{seed}", args, threads=1))

        def watch() -> None:
            nonlocal most_at_once
            server.check_alive()
            ready = [s for s in server.status()["sessions"] if s["state"] == "ready"]
            most_at_once = max(most_at_once, len({s["job_id"] for s in ready}))

        wait_all(runs, timeout_s=cfg.run_timeout_s, on_poll=watch, poll_s=0.5)
        for (name, _, seed), run in zip(wave, runs):
            curve = [(0, warm_match[seed])] + [(m["step"], m["eval_exact_match"]) for m in run.metrics()
                                               if "eval_exact_match" in m]
            results.append(ArmResult(name, seed, curve[-1][1], curve, wall_s=run.wall_s))
            say(f"  {name} seed {seed}: held-out exact match {curve[-1][1]:.3f} ({run.wall_s:.0f} s)")
    say(f"  jobs sharing the teacher at once: up to {most_at_once}")
    return results


def teacher_loglik(server_address: str, model_dir: Path, data: Data, cfg: CompareConfig, seed: int) -> float:
    """The teacher's mean log-probability per token of the student's completions of the held-out
    prompts, sampled at temperature 1 and scored by the served teacher (NextTokenLogprobs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill_common.outputs import NextTokenLogprobs
    from student_trainer.client import TeacherClient
    from student_trainer.data import PromptDataset, prompt_lengths
    from student_trainer.onpolicy import sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PromptDataset(data.heldout, tokenizer, cfg.seq_len, min_new_tokens=cfg.digits + 2)
    lengths = prompt_lengths(prompts.loss_mask)
    generator = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    with TeacherClient(server_address, "cpu", outputs=(NextTokenLogprobs(),), job_id=f"loglik-seed{seed}") as teacher:
        for start in range(0, len(prompts), 100):
            rows = range(start, min(start + 100, len(prompts)))
            asked = [prompts.input_ids[row, :lengths[row]] for row in rows]
            completions, _ = sample(model, asked, max_new_tokens=cfg.digits + 2, temperature=1.0, top_p=1.0,
                                    stop_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id,
                                    generator=generator)
            width = max(len(p) + len(c) for p, c in zip(asked, completions))
            ids = torch.full((len(asked), width), tokenizer.pad_token_id)
            mask, scored = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
            for row, (prompt, completion) in enumerate(zip(asked, completions)):
                end = len(prompt) + len(completion)
                ids[row, :end] = torch.cat([prompt, completion])
                mask[row, :end] = 1
                scored[row, len(prompt) - 1:end - 1] = True  # the positions that predict the completion
            logprobs = teacher.submit(ids, mask).result(timeout=300).next_token_logprobs
            total += float(logprobs[scored].sum())
            count += int(scored.sum())
    return total / count


# ---- 5. report ------------------------------------------------------------------------------------------


def by_arm(results: list[ArmResult], arm: str, key: str = "exact_match") -> list[float]:
    return [getattr(r, key) for r in sorted(results, key=lambda r: r.seed) if r.arm == arm]


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def table(cfg: CompareConfig, results: list[ArmResult], teacher_match: float, dataset_right: float,
          warm_match: dict[int, float]) -> list[str]:
    seeds = list(cfg.seeds)
    header = ["", *[f"seed {s}" for s in seeds], "mean", "spread", "teacher log-lik/token"]
    rows = [["teacher", *["-"] * len(seeds), f"{teacher_match:.3f}", "-", "-"],
            ["the dataset's answers", *["-"] * len(seeds), f"{dataset_right:.3f}", "-", "-"],
            ["warm student (start)", *[f"{warm_match[s]:.3f}" for s in seeds],
             f"{statistics.fmean(warm_match.values()):.3f}", f"{spread(list(warm_match.values())):.3f}", "-"]]
    for name, label, _ in ARMS:
        matches, logliks = by_arm(results, name), by_arm(results, name, "teacher_loglik")
        rows.append([label, *[f"{m:.3f}" for m in matches], f"{statistics.fmean(matches):.3f}",
                     f"{spread(matches):.3f}", f"{statistics.fmean(logliks):.3f}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def plot(cfg: CompareConfig, results: list[ArmResult], teacher_match: float, path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for index, (name, label, _) in enumerate(ARMS):
        runs = [r for r in results if r.arm == name]
        steps = [step for step, _ in runs[0].curve]
        values = [[match for _, match in r.curve] for r in runs]
        mean = [statistics.fmean(column) for column in zip(*values)]
        color = f"C{index}"
        curves.plot(steps, mean, color=color, label=label)
        curves.fill_between(steps, [min(c) for c in zip(*values)], [max(c) for c in zip(*values)], color=color,
                            alpha=0.15)
        logliks = by_arm(results, name, "teacher_loglik")
        bars.bar(index, statistics.fmean(logliks), color=color)
        bars.scatter([index] * len(logliks), logliks, color="black", s=10, zorder=3)
    curves.axhline(teacher_match, color="gray", linestyle="--", label="teacher")
    curves.set_xlabel("student step")
    curves.set_ylabel("held-out exact match")
    curves.legend(fontsize=8)
    curves.set_title(f"mean over seeds {','.join(map(str, cfg.seeds))}, band: min-max")
    bars.set_xticks(range(len(ARMS)), [label for _, label, _ in ARMS], rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("teacher log-likelihood per token")
    bars.set_title("of the students' samples (T=1)")
    figure.suptitle(f"{cfg.student.hidden_size}-wide student, {cfg.teacher.hidden_size}-wide teacher: "
                    f"{cfg.digits}-digit sums, the dataset's units carry dropped with p={cfg.slip}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# ---- the comparison, top to bottom -----------------------------------------------------------------------


def run(cfg: CompareConfig) -> dict:
    from distill_demo.processes import TeacherProcess

    started = time.monotonic()
    out, cache = Path(cfg.output_dir), Path(cfg.cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"on-policy comparison; output {out}, cache {cache}; settings (non-default): {non_defaults(cfg) or 'none'}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    data = prepare_data(cfg, cache)

    say(f"[2/{STEPS}] teacher: a {cfg.teacher.hidden_size}-wide {cfg.teacher.num_layers}-layer Llama, "
        f"{cfg.teacher_steps} steps of CE on its problems; students: {cfg.student.hidden_size}-wide "
        f"{cfg.student.num_layers}-layer Llamas warmed up with {cfg.warmup_steps} steps of CE on the dataset, one per "
        "seed (all cached)")
    teacher = Trained("teacher", cfg.teacher_settings(), cfg.teacher, 0, [
        "--data", str(data.teacher), "--kd-weight", "0", "--on-policy-fraction", "0", "--lr", str(cfg.teacher_lr),
        "--schedule", "cosine", "--warmup-steps", str(cfg.teacher_steps // 10)], cfg.teacher_steps,
        cfg.teacher_batch_size)
    students = [Trained(f"student-seed{seed}", cfg.warmup_settings(seed), cfg.student, 100 + seed, [
        "--data", str(data.students), "--kd-weight", "0", "--on-policy-fraction", "0", "--lr", str(cfg.warmup_lr),
        "--schedule", "cosine", "--warmup-steps", str(cfg.warmup_steps // 10)],
        cfg.warmup_steps, cfg.batch_size) for seed in cfg.seeds]
    ensure_trained(cfg, [teacher, *students], data, cache, out)
    teacher_dir, teacher_match = teacher.model_dir, teacher.exact_match
    say(f"  teacher: {teacher.params / 1e3:.0f}k parameters; held-out exact match {teacher_match:.3f}")
    warm = {seed: job.model_dir for seed, job in zip(cfg.seeds, students)}
    warm_match = {seed: job.exact_match for seed, job in zip(cfg.seeds, students)}
    for seed, job in zip(cfg.seeds, students):
        say(f"  student seed {seed}: {job.params / 1e3:.0f}k parameters; held-out exact match {job.exact_match:.3f}")

    say(f"[4/{STEPS}] arms: {cfg.steps} steps each from the warm students, {cfg.parallel} at a time against one "
        "teacher server")
    with TeacherProcess(teacher_dir, out / "teacher_server.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as server:
        results = run_arms(cfg, data, warm, warm_match, server, out)
        say(f"[5/{STEPS}] the teacher's log-likelihood of each student's samples (held-out prompts, T=1)")
        for result in results:
            result.teacher_loglik = teacher_loglik(server.address, out / f"{result.arm}-seed{result.seed}" / "model",
                                                   data, cfg, result.seed)

    lines = table(cfg, results, teacher_match, data.dataset_right, warm_match)
    on, none = by_arm(results, "onpolicy"), by_arm(results, "none")
    beats = statistics.fmean(on) - spread(on) > statistics.fmean(none) + spread(none)
    lines += ["", f"held-out exact match after {cfg.steps} steps per arm (greedy); teacher log-likelihood: mean "
                  "log p_teacher per token of the student's samples",
              f"on-policy beats no distillation by more than the spread over seeds (mean - spread > mean + spread: "
              f"{statistics.fmean(on) - spread(on):.3f} > {statistics.fmean(none) + spread(none):.3f}): "
              f"{'yes' if beats else 'NO'}"]
    say("\n" + "\n".join(lines))
    (out / "onpolicy.png").unlink(missing_ok=True)
    figure = plot(cfg, results, teacher_match, out / "onpolicy.png")
    say(f"figure: {figure}" if figure else "figure: skipped, matplotlib is not installed "
        "(pip install 'teacher-service[plot]')")
    summary = {"settings": {**dataclasses.asdict(cfg), "seeds": list(cfg.seeds)}, "teacher_exact_match": teacher_match,
               "dataset_right": data.dataset_right, "warm_exact_match": warm_match,
               "arms": [dataclasses.asdict(r) for r in results], "onpolicy_beats_none": beats,
               "table": lines, "wall_s": time.monotonic() - started}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"results: {out / 'results.json'}; total {time.monotonic() - started:.0f} s")
    return summary


def main(argv: list[str] | None = None) -> int:
    from distill_demo.config import parse_settings

    cfg = parse_settings(CompareConfig, argv, "python -m distill_demo.onpolicy_compare", __doc__.split("\n\n")[0],
                         quick=QUICK)
    from distill_demo.processes import run_command

    return run_command("onpolicy_compare", lambda: run(cfg))


if __name__ == "__main__":
    sys.exit(main())
