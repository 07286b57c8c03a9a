"""The demo's settings: one dataclass, checked once, errors that name the flag.

Two presets: the full demo (a few minutes on 2 CPU cores) and `--quick` (tiny models
and a few steps, for tests: it shows that the pipeline runs end to end, not that KD
wins). Any flag given explicitly overrides the preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A Llama body; the vocabulary comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int

    def check(self, role: str) -> None:
        if min(self.hidden_size, self.num_layers, self.intermediate_size, self.num_heads) < 1:
            raise ValueError(f"the {role}'s sizes must all be >= 1, got {self}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"the {role}'s hidden_size {self.hidden_size} is not a multiple of its "
                             f"num_heads {self.num_heads}")


@dataclass
class DemoConfig:
    output_dir: str = "runs/demo"
    cache_dir: str = ".cache/distill_demo"
    quick: bool = False
    # Data: a slice of the stdlib, split into train and held-out by file.
    max_files: int = 150
    heldout_fraction: float = 0.1
    seq_chars: int = 2000
    split_seed: int = 0
    vocab_size: int = 1024
    seq_len: int = 128
    # Teacher: trained once with plain cross-entropy, then cached.
    # Wide and shallow: on a CPU budget two 256-wide layers learn faster per second than four
    # narrower ones, which sit on a plateau near the unigram loss for their first ~150 steps.
    teacher: ModelShape = ModelShape(hidden_size=256, num_layers=2, intermediate_size=704, num_heads=8)
    teacher_steps: int = 600
    teacher_lr: float = 3e-3
    teacher_batch_size: int = 16
    # Students: two seeds distilled at once from one teacher, and the same two with CE only.
    student: ModelShape = ModelShape(hidden_size=64, num_layers=2, intermediate_size=192, num_heads=4)
    student_steps: int = 200
    student_lr: float = 3e-3
    student_batch_size: int = 16
    kd_weight: float = 0.7
    temperature: float = 1.0
    seeds: tuple[int, ...] = (0, 1)
    eval_every: int = 20
    # Waits: every child process has a deadline.
    startup_timeout_s: float = 120.0
    run_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        self.seeds = tuple(int(s) for s in self.seeds)
        self.teacher.check("teacher")
        self.student.check("student")
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {self.seeds}: give at least two different seeds, e.g. --seeds 0,1 "
                             "(the spread over seeds is what KD must beat)")
        for flag in ("max_files", "seq_len", "teacher_steps", "teacher_batch_size", "student_steps",
                     "student_batch_size", "eval_every"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.max_files < 2:
            raise ValueError("--max-files must be >= 2: one file at least for each of train and held-out")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"--heldout-fraction {self.heldout_fraction} must lie in (0, 1), e.g. 0.1")
        if not 0 < self.kd_weight <= 1:
            raise ValueError(f"--kd-weight {self.kd_weight} must lie in (0, 1]: the KD students need a KD term "
                             "(the CE-only baselines are trained anyway)")
        if self.temperature <= 0:
            raise ValueError("--temperature must be > 0")
        for flag in ("teacher_lr", "student_lr"):
            if getattr(self, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0, e.g. 3e-3")
        if self.startup_timeout_s <= 0 or self.run_timeout_s <= 0:
            raise ValueError("--startup-timeout-s and --run-timeout-s must be > 0")

    # ---- presets and flags -------------------------------------------------------

    @classmethod
    def quick_preset(cls) -> dict:
        """Tiny everything: about 30 s cold on 2 cores, most of it process start-up."""
        return dict(max_files=12, vocab_size=320, seq_len=64,
                    teacher=ModelShape(hidden_size=48, num_layers=1, intermediate_size=96, num_heads=4),
                    teacher_steps=40, teacher_lr=3e-3, teacher_batch_size=8,
                    student=ModelShape(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2),
                    student_steps=20, student_lr=3e-3, student_batch_size=8, eval_every=10)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        # Defaults are None so that explicit flags can be told apart from the preset's values.
        p.add_argument("--output-dir", help="student runs, logs, results.json and loss_curves.png "
                                            "(default: runs/demo)")
        p.add_argument("--cache-dir", help="corpus, tokenizer and trained teacher, reused across runs "
                                           "(default: .cache/distill_demo)")
        p.add_argument("--quick", action="store_true", help="tiny models and few steps: checks the pipeline only")
        p.add_argument("--max-files", type=int, help="stdlib files in the corpus (default 150)")
        p.add_argument("--vocab-size", type=int, help="BPE vocabulary (default 1024)")
        p.add_argument("--seq-len", type=int, help="tokens per training sequence (default 128)")
        p.add_argument("--teacher-steps", type=int, help="teacher training steps (default 600)")
        p.add_argument("--teacher-lr", type=float)
        p.add_argument("--student-steps", type=int, help="steps of every student, KD and CE alike (default 200)")
        p.add_argument("--student-lr", type=float)
        p.add_argument("--kd-weight", type=float, help="alpha in alpha*KD + (1-alpha)*CE (default 0.7)")
        p.add_argument("--temperature", type=float, help="KD softmax temperature (default 1.0)")
        p.add_argument("--seeds", help="comma-separated student seeds, one KD and one CE student each "
                                       "(default 0,1)")
        p.add_argument("--eval-every", type=int, help="student steps between held-out evaluations")
        p.add_argument("--startup-timeout-s", type=float, help="how long to wait for the teacher server's READY")
        p.add_argument("--run-timeout-s", type=float, help="how long one training phase may take")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DemoConfig":
        values = cls.quick_preset() if args.quick else {}
        values["quick"] = args.quick
        for f in dataclasses.fields(cls):
            given = getattr(args, f.name, None)
            if given is not None and f.name != "quick":
                values[f.name] = given
        if isinstance(values.get("seeds"), str):
            try:
                values["seeds"] = tuple(int(s) for s in values["seeds"].split(",") if s.strip())
            except ValueError as e:
                raise ValueError(f"--seeds {args.seeds!r}: use integers separated by commas, e.g. 0,1") from e
        return cls(**values)

    def non_defaults(self) -> dict:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    # ---- cache keys ----------------------------------------------------------------

    def data_settings(self) -> dict:
        """Everything the corpus and tokenizer depend on (the stdlib differs by Python version)."""
        return {"python": ".".join(map(str, sys.version_info[:2])), "max_files": self.max_files,
                "heldout_fraction": self.heldout_fraction, "seq_chars": self.seq_chars,
                "split_seed": self.split_seed, "vocab_size": self.vocab_size}

    def teacher_settings(self) -> dict:
        """Everything the trained teacher depends on."""
        return {"data": self.data_settings(), "shape": dataclasses.asdict(self.teacher), "seq_len": self.seq_len,
                "steps": self.teacher_steps, "lr": self.teacher_lr, "batch_size": self.teacher_batch_size}


def settings_key(settings: dict) -> str:
    """A short, stable name for a set of settings (a cache directory's suffix)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
