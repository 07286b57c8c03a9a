"""One student, two domain teachers: `python -m distill_demo.several_teachers`.

Two domains of local text, both from the standard library: Python source (each file's code,
its docstrings and comments taken out: `ast.unparse`) and English prose (the docstrings
themselves). One byte-level BPE tokenizer on both; train and held-out split by file. Two
teachers, each trained on its own domain only (plain CE by the project's trainer, cached), served
side by side. Per seed, students from one random init, on the same mixed training data, data
order and steps:

    code teacher     KD from the code teacher alone, on every example
    prose teacher    KD from the prose teacher alone
    both, routed     KD from both: each example scored by its domain's teacher
                     (--teacher-route field:domain)
    both, mixture    KD from both: every example against the mixture of their distributions
                     (--teacher-combine mixture)
    CE only          no teacher

scored by the mean cross-entropy per token on each domain's held-out files and on the mixed set
(the mean of the two: as many tokens of each). The students' training data is mixed the same
way: as many characters of code as of prose (the stdlib holds several times more code).
The table says whether the two-teacher students beat each single-teacher student beyond the
spread over seeds; docs/training.md quotes it.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from distill_demo.config import DemoConfig, settings_key

DOMAINS = ("code", "prose")
ARMS = ("code", "prose", "routed", "mixture", "ce")
ARM_NAMES = {"code": "KD, code teacher alone", "prose": "KD, prose teacher alone",
             "routed": "KD, both (each example its domain's teacher)", "mixture": "KD, both (their mixture)",
             "ce": "CE only (no teacher)"}


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class SeveralTeachersConfig(DemoConfig):
    output_dir: str = field(default="runs/several_teachers", metadata=_help(
        "student runs, logs and results.json"))
    min_docstring_chars: int = field(default=40, metadata=_help(
        "docstrings shorter than this are left out of the prose (one-line labels say little)"))
    concurrent: int = field(default=4, metadata=_help("student processes training at once"))

    def __post_init__(self) -> None:
        super().__post_init__()
        from distill_common.settings import ConfigError

        if self.concurrent < 1:
            raise ConfigError("--concurrent must be >= 1")

    def data_settings(self) -> dict:
        return {**super().data_settings(), "domains": "code-prose/2", "min_docstring_chars": self.min_docstring_chars}


# ---- the two domains -------------------------------------------------------------------------------


def split_domains(source: str, min_docstring_chars: int) -> tuple[str, str] | None:
    """A Python file as (its code without docstrings and comments, its docstrings as prose), or
    None when it does not parse (a file of another Python's grammar)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    prose = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                text = inspect.cleandoc(first.value.value)
                if len(text) >= min_docstring_chars:
                    prose.append(text)
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n", "\n\n".join(prose) + "\n" if prose else ""


@dataclass
class Domains:
    """The corpus of both domains, written once and cached."""

    directory: Path
    tokenizer_dir: Path
    vocab_size: int

    def train(self, domain: str | None = None) -> Path:
        """The training examples of `domain`, or of both (each with its "domain" field)."""
        return self.directory / f"train-{domain or 'mixed'}.jsonl"

    def heldout(self, domain: str | None = None) -> Path:
        return self.directory / f"heldout-{domain or 'mixed'}.jsonl"


def prepare_domains(cfg: SeveralTeachersConfig, cache: Path) -> Domains:
    from distill_demo.corpus import chunk_text, split_files, stdlib_files, stdlib_root
    from distill_demo.demo import _publish, _staging_dir, say
    from distill_demo.tokenizer import load_or_train_tokenizer

    directory = cache / f"domains-{settings_key(cfg.data_settings())}"
    marker = directory / "settings.json"
    if not marker.is_file():
        say(f"data: {cfg.max_files} stdlib files -> code (without docstrings) and prose (the docstrings), "
            f"split by file, a {cfg.vocab_size}-token BPE on both")
        root, files = stdlib_root(), stdlib_files()
        files = [files[i * len(files) // cfg.max_files] for i in range(min(cfg.max_files, len(files)))]
        relative = [path.relative_to(root).as_posix() for path in files]
        heldout = split_files(relative, cfg.heldout_fraction, cfg.split_seed)
        # (split, domain) -> examples; domain None: both domains, as much of each (below).
        records: dict[tuple[str, str | None], list[dict]] = {(split, domain): [] for split in ("train", "heldout")
                                                             for domain in (*DOMAINS, None)}
        for path, name in zip(files, relative):
            parts = split_domains(path.read_text(encoding="utf-8"), cfg.min_docstring_chars)
            if parts is None:
                continue
            split = "heldout" if name in heldout else "train"
            for domain, text in zip(DOMAINS, parts):
                records[split, domain] += [{"text": chunk, "domain": domain, "source": name}
                                           for chunk in chunk_text(text, cfg.seq_chars)]
        for split in ("train", "heldout"):
            records[split, None] = balanced(records[split, "code"], records[split, "prose"])
        staging = _staging_dir(directory)
        try:
            for (split, domain), rows in records.items():
                (staging / f"{split}-{domain or 'mixed'}.jsonl").write_text(
                    "".join(json.dumps(row) + "\n" for row in rows))
            texts = [row["text"] for domain in DOMAINS for row in records["train", domain]]
            load_or_train_tokenizer(staging / "tokenizer", lambda: iter(texts), cfg.vocab_size)
            marker_text = json.dumps({**cfg.data_settings(), "chunks": {f"{s}-{d or 'mixed'}": len(rows)
                                                                        for (s, d), rows in records.items()}}, indent=2)
            (staging / "settings.json").write_text(marker_text + "\n")
            _publish(staging, directory, marker)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    tokenizer_dir = directory / "tokenizer"
    vocab = len(load_or_train_tokenizer(tokenizer_dir, lambda: iter(()), cfg.vocab_size))
    counts = json.loads(marker.read_text())["chunks"]
    say(f"data: cached in {directory}: {counts}")
    return Domains(directory, tokenizer_dir, vocab)


def balanced(code: list[dict], prose: list[dict]) -> list[dict]:
    """Both domains' examples with as many characters of each (the stdlib has several times more code
    than docstrings): evenly spaced code examples up to the prose's size, alternating with the prose."""
    prose_chars, code_chars = sum(len(r["text"]) for r in prose), sum(len(r["text"]) for r in code)
    keep = min(len(code), max(1, round(len(code) * prose_chars / max(code_chars, 1))))
    code = [code[i * len(code) // keep] for i in range(keep)]
    mixed = []
    for i in range(max(len(code), len(prose))):
        mixed += code[i:i + 1] + prose[i:i + 1]
    return mixed


# ---- the run ----------------------------------------------------------------------------------------


def run(cfg: SeveralTeachersConfig) -> dict:
    from distill_demo.demo import DemoData, _quiet_transformers, ensure_teacher, save_random_llama, say
    from distill_demo.processes import TeacherProcess, TrainerRun, wait_all

    started = time.monotonic()
    out, cache = Path(cfg.output_dir), Path(cfg.cache_dir)
    _quiet_transformers()
    domains = prepare_domains(cfg, cache)
    teachers = {}
    for domain in DOMAINS:  # each trained on its own domain only; cached beside the corpus
        data = DemoData(domains.train(domain), domains.heldout(domain), domains.tokenizer_dir, domains.vocab_size)
        say(f"\n{domain} teacher:")
        teachers[domain] = ensure_teacher(cfg, domains.directory / f"teacher-{domain}", data, out / domain,
                                          threads=os.cpu_count() or 1)
    mixed = DemoData(domains.train(), domains.heldout(), domains.tokenizer_dir, domains.vocab_size)
    inits = {seed: out / "init" / f"seed{seed}" for seed in cfg.seeds}
    for seed, path in inits.items():
        save_random_llama(path, cfg.student, mixed, cfg.seq_len, seed)

    def args(arm: str, seed: int, addresses: dict) -> list[str]:
        common = ["--model", str(inits[seed]), "--data", str(domains.train()), "--max-steps", str(cfg.student_steps),
                  "--batch-size", str(cfg.student_batch_size), "--seq-len", str(cfg.seq_len),
                  "--lr", str(cfg.student_lr), "--warmup-steps", str(cfg.student_steps // 10), "--seed", str(seed),
                  "--temperature", str(cfg.temperature), "--job-id", f"{arm}-seed{seed}"]
        if arm == "ce":
            return [*common, "--kd-weight", "0"]
        common += ["--kd-weight", str(cfg.kd_weight)]
        if arm in DOMAINS:
            return [*common, "--teacher", addresses[arm]]
        specs = [arg for domain in DOMAINS for arg in ("--teacher-spec", f"name={domain},address={addresses[domain]}")]
        how = ["--teacher-route", "field:domain"] if arm == "routed" else ["--teacher-combine", "mixture"]
        return [*common, *specs, *how]

    runs: dict[tuple[str, int], TrainerRun] = {}
    kd_arms = [arm for arm in ARMS if arm != "ce"]
    say(f"\nstudents: {', '.join(ARM_NAMES[a] for a in ARMS)}; seeds {list(cfg.seeds)}, {cfg.student_steps} steps "
        f"each, {cfg.concurrent} at a time")
    with TeacherProcess(teachers["code"].model_dir, out / "teacher_code.log", startup_timeout_s=cfg.startup_timeout_s,
                        threads=1) as code, \
            TeacherProcess(teachers["prose"].model_dir, out / "teacher_prose.log",
                           startup_timeout_s=cfg.startup_timeout_s, threads=1) as prose:
        addresses = {"code": code.address, "prose": prose.address}

        def alive() -> None:
            code.check_alive()
            prose.check_alive()

        pending = [(arm, seed) for seed in cfg.seeds for arm in ARMS]
        while pending:
            batch, pending = pending[:cfg.concurrent], pending[cfg.concurrent:]
            for arm, seed in batch:
                runs[arm, seed] = TrainerRun(f"{arm} seed {seed}", out / f"{arm}-seed{seed}",
                                             args(arm, seed, addresses), threads=1)
            wait_all([runs[key] for key in batch], timeout_s=cfg.run_timeout_s,
                     on_poll=alive if any(arm in kd_arms for arm, _ in batch) else lambda: None)

    say("\nscoring every student and both teachers on the held-out sets")
    scores = {key: heldout_ce(r.run_dir / "model", domains, cfg.seq_len) for key, r in runs.items()}
    teacher_scores = {domain: heldout_ce(t.model_dir, domains, cfg.seq_len) for domain, t in teachers.items()}
    result = summarize(cfg, scores, teacher_scores)
    result["wall_s"] = time.monotonic() - started
    result["students_wall_s"] = sum(r.wall_s for r in runs.values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    say(table(cfg, result))
    return result


def heldout_ce(model_dir: Path, domains: Domains, seq_len: int) -> dict[str, float]:
    """Mean cross-entropy per target token on each domain's held-out examples, packed as training
    packs them, and on the mixed set: the mean of the two (a set with as many tokens of each)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from student_trainer.data import PackedDataset

    tokenizer = AutoTokenizer.from_pretrained(domains.tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sums = {}
    with torch.no_grad():
        for domain in DOMAINS:
            data = PackedDataset(domains.heldout(domain), tokenizer, seq_len)
            nats, tokens = 0.0, 0
            for start in range(0, len(data), 16):
                ids = data.input_ids[start:start + 16]
                attention = data.attention_mask[start:start + 16]
                mask = (data.loss_mask[start:start + 16, 1:] * attention[:, 1:]).bool()
                logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
                nats += F.cross_entropy(logits[mask].float(), ids[:, 1:][mask], reduction="sum").item()
                tokens += int(mask.sum())
            sums[domain] = (nats, tokens)
    scores = {domain: nats / tokens for domain, (nats, tokens) in sums.items()}
    scores["mixed"] = statistics.fmean(scores[domain] for domain in DOMAINS)  # each domain weighs the same
    return scores


def summarize(cfg: SeveralTeachersConfig, scores: dict, teacher_scores: dict) -> dict:
    groups = {}
    for arm in ARMS:
        per_seed = [scores[arm, seed] for seed in cfg.seeds]
        groups[arm] = {split: {"values": [s[split] for s in per_seed],
                               "mean": statistics.fmean(s[split] for s in per_seed),
                               "spread": (max(s[split] for s in per_seed) - min(s[split] for s in per_seed)) / 2}
                       for split in ("mixed", *DOMAINS)}
    beats = {}
    for two in ("routed", "mixture"):
        for one in DOMAINS:
            a, b = groups[two]["mixed"], groups[one]["mixed"]
            beats[f"{two}_vs_{one}"] = a["mean"] + a["spread"] < b["mean"] - b["spread"]
    return {"groups": groups, "teachers": teacher_scores, "beats": beats,
            "settings": {"teacher": cfg.teacher.__dict__, "student": cfg.student.__dict__,
                         "teacher_steps": cfg.teacher_steps, "student_steps": cfg.student_steps,
                         "kd_weight": cfg.kd_weight, "seeds": list(cfg.seeds), "vocab": cfg.vocab_size,
                         "max_files": cfg.max_files, "seq_len": cfg.seq_len}}


def table(cfg: SeveralTeachersConfig, result: dict) -> str:
    seeds = list(cfg.seeds)
    lines = ["held-out cross-entropy per token (nats) on each domain's held-out files, and on the mixed set (as "
             "many tokens of each: the mean of the two)",
             "", f"| student | {' | '.join(f'mixed, seed {s}' for s in seeds)} | mixed, mean ± half-range "
             "| code, mean | prose, mean |", "|---|" + "---:|" * (len(seeds) + 3)]
    for arm in ARMS:
        group = result["groups"][arm]
        mixed = group["mixed"]
        lines.append(f"| {ARM_NAMES[arm]} | {' | '.join(f'{v:.4f}' for v in mixed['values'])} | "
                     f"{mixed['mean']:.4f} ± {mixed['spread']:.4f} | {group['code']['mean']:.4f} | "
                     f"{group['prose']['mean']:.4f} |")
    for domain, score in result["teachers"].items():
        lines.append(f"| {domain} teacher | {' | '.join('' for _ in seeds)} | {score['mixed']:.4f} | "
                     f"{score['code']:.4f} | {score['prose']:.4f} |")
    lines.append("")
    for key, holds in result["beats"].items():
        two, one = key.split("_vs_")
        a, b = result["groups"][two]["mixed"], result["groups"][one]["mixed"]
        lines.append(f"{ARM_NAMES[two]} beats {ARM_NAMES[one]} on the mixed set beyond the spread "
                     f"({a['mean']:.4f} + {a['spread']:.4f} < {b['mean']:.4f} - {b['spread']:.4f}): "
                     f"{'yes' if holds else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from distill_demo.config import QUICK, parse_settings

    config = parse_settings(SeveralTeachersConfig, argv, "python -m distill_demo.several_teachers",
                            __doc__.splitlines()[0], quick=QUICK)
    from distill_demo.processes import run_command

    return run_command("distill_demo.several_teachers", lambda: run(config))


if __name__ == "__main__":
    sys.exit(main())
