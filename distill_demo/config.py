"""The demo's settings: one dataclass, checked once, errors that name the flag.

Two presets: the full demo, the fields' defaults (a few minutes on 2 CPU cores), and
`--quick` (`QUICK`: tiny models and a few steps, for tests: it shows that the pipeline runs
end to end, not that KD wins). Any flag given explicitly overrides the preset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field

from distill_common.settings import ConfigError, IntTuple, flag


@dataclass(frozen=True)
class ModelShape:
    """A Llama body; the vocabulary comes from the tokenizer."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int


# Wide and shallow: on a CPU budget two 256-wide layers learn faster per second than four
# narrower ones, which sit on a plateau near the unigram loss for their first ~150 steps.
TEACHER = ModelShape(hidden_size=256, num_layers=2, intermediate_size=704, num_heads=8)
STUDENT = ModelShape(hidden_size=64, num_layers=2, intermediate_size=192, num_heads=4)
QUICK_TEACHER = ModelShape(hidden_size=48, num_layers=1, intermediate_size=96, num_heads=4)
QUICK_STUDENT = ModelShape(hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2)

# --quick: tiny everything, about 30 s cold on 2 cores, most of it process start-up. The
# command line's defaults under --quick (flags given explicitly still win); the model shapes
# follow `quick` itself.
QUICK = dict(max_files=12, vocab_size=320, seq_len=64, teacher_steps=40, teacher_lr=3e-3, teacher_batch_size=8,
             student_steps=20, student_lr=3e-3, student_batch_size=8, eval_every=10)


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class DemoConfig:
    output_dir: str = field(default="runs/demo", metadata=_help(
        "student runs, logs, results.json and loss_curves.png"))
    cache_dir: str = field(default=".cache/distill_demo", metadata=_help(
        "corpus, tokenizer and trained teacher, reused across runs"))
    quick: bool = field(default=False, metadata=_help(
        "tiny models and few steps: checks the pipeline only (flags given explicitly override its values)"))
    # Data: a slice of the stdlib, split into train and held-out by file.
    max_files: int = field(default=150, metadata=_help("stdlib files in the corpus"))
    heldout_fraction: float = field(default=0.1, metadata=_help("share of the files held out for evaluation"))
    seq_chars: int = field(default=2000, metadata=_help("most characters per example (source cut at line ends)"))
    split_seed: int = field(default=0, metadata=_help("seed of the train / held-out split"))
    vocab_size: int = field(default=1024, metadata=_help("BPE vocabulary"))
    seq_len: int = field(default=128, metadata=_help("tokens per training sequence"))
    # Teacher: trained once with plain cross-entropy, then cached.
    teacher_steps: int = field(default=600, metadata=_help("teacher training steps"))
    teacher_lr: float = field(default=3e-3, metadata=_help("teacher learning rate"))
    teacher_batch_size: int = field(default=16, metadata=_help("teacher training batch size"))
    # Students: two seeds distilled at once from one teacher, and the same two with CE only.
    student_steps: int = field(default=200, metadata=_help("steps of every student, KD and CE alike"))
    student_lr: float = field(default=3e-3, metadata=_help("student learning rate"))
    student_batch_size: int = field(default=16, metadata=_help("student batch size"))
    kd_weight: float = field(default=0.7, metadata=_help("alpha in alpha*KD + (1-alpha)*CE"))
    temperature: float = field(default=1.0, metadata=_help("KD softmax temperature"))
    seeds: IntTuple = field(default=(0, 1), metadata=_help(
        "comma-separated student seeds, one KD and one CE student each"))
    eval_every: int = field(default=20, metadata=_help("student steps between held-out evaluations"))
    # Waits: every child process has a deadline.
    startup_timeout_s: float = field(default=120.0, metadata=_help(
        "how long to wait for the teacher server's READY"))
    run_timeout_s: float = field(default=900.0, metadata=_help("how long one training phase may take"))
    teacher: ModelShape = field(init=False)
    student: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        self.seeds = IntTuple(self.seeds)
        self.teacher = QUICK_TEACHER if self.quick else TEACHER
        self.student = QUICK_STUDENT if self.quick else STUDENT
        if len(self.seeds) < 2 or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"--seeds {','.join(map(str, self.seeds))}: give at least two different seeds, e.g. "
                              "--seeds 0,1 (the spread over seeds is what KD must beat)")
        for name in ("max_files", "seq_len", "teacher_steps", "teacher_batch_size", "student_steps",
                     "student_batch_size", "eval_every", "seq_chars", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.max_files < 2:
            raise ConfigError("--max-files must be >= 2: one file at least for each of train and held-out")
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"--heldout-fraction {self.heldout_fraction} must lie in (0, 1), e.g. 0.1")
        if not 0 < self.kd_weight <= 1:
            raise ConfigError(f"--kd-weight {self.kd_weight} must lie in (0, 1]: the KD students need a KD term "
                              "(the CE-only baselines are trained anyway)")
        if self.temperature <= 0:
            raise ConfigError("--temperature must be > 0")
        for name in ("teacher_lr", "student_lr"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0, e.g. 3e-3")
        if self.startup_timeout_s <= 0 or self.run_timeout_s <= 0:
            raise ConfigError("--startup-timeout-s and --run-timeout-s must be > 0")

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


def parse_settings(settings: type, argv: list[str] | None, prog: str, description: str, quick: dict | None = None):
    """The demo command's `settings` from its flags. `quick`: the preset `--quick` applies, under
    the flags given explicitly (None: the command has no --quick). A value the settings refuse
    ends the command with a usage error that names the flag."""
    from distill_common.settings import settings_from, settings_parser

    parser = settings_parser(settings, prog=prog, description=description)
    if quick is not None and parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**quick)
    args = parser.parse_args(argv)
    try:
        return settings_from(settings, args)
    except ConfigError as e:
        parser.error(str(e))
