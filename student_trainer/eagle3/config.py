"""Settings of `student-trainer eagle3` (training) and `student-trainer eagle3-eval` (acceptance length).

Each is one dataclass whose fields are the flags (distill_common/settings.py). The settings the
KD trainer has too (data, optimisation, the teacher connection) take their default and help
text from `TrainConfig`'s field of the same name, so the two commands cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from distill_common.settings import ConfigError, IntTuple, check_choices, flag
from student_trainer.config import TrainConfig, check_max_teacher_kl
from student_trainer.data import PackMode


def _help(text: str) -> dict:
    return {"help": text}


def _as_in_train(name: str, **changes):
    """The KD trainer's field `name` (default and help), with `changes` (e.g. another default)."""
    original = TrainConfig.__dataclass_fields__[name]
    default = changes.get("default", original.default)
    return field(default=default, metadata=changes.get("metadata", original.metadata))


ExportDtype = Literal["bfloat16", "float16", "float32"]


@dataclass
class Eagle3Config:
    target_model: str = field(metadata=_help(
        "the teacher's model directory (what the teacher server was started with): the draft takes its token "
        "embedding, its shape and its tokenizer from there"))
    data: str = _as_in_train("data")
    teacher: str = field(default="", metadata=_help(
        "the teacher server's gRPC address, HOST:PORT (or --teacher-outputs)"))
    teacher_outputs: str = field(default="", metadata=_help(
        "read the teacher's outputs from this store (student-trainer dump --eagle3) instead of a live teacher; "
        "with --teacher too, what the store lacks is asked of the teacher and written into it"))
    output_dir: str = field(default="runs/eagle3", metadata=_help(
        "checkpoints, metrics.jsonl and the exported draft (OUTPUT_DIR/draft)"))
    tokenizer: str = field(default="", metadata=_help("default: --target-model"))
    draft_vocab_size: int = field(default=32000, metadata=_help(
        "N: the draft predicts the N most frequent target tokens of --data (capped at the target's vocabulary)"))
    ttt_steps: int = field(default=7, metadata=_help(
        "K: steps of the training-time test (the draft unrolled on its own outputs)"))
    step_decay: float = field(default=0.8, metadata=_help("step k of the unroll weighs step_decay^k in the loss"))
    aux_layers: IntTuple = field(default=(), metadata=_help(
        "the teacher's three layers the draft reads (HF hidden-state indices, e.g. 2,16,29); default: the "
        "teacher's choice, 2, L//2, L-3, as vLLM and SGLang capture them"))
    intermediate_size: int = field(default=0, metadata=_help("the draft layer's MLP width (0: the target's)"))
    teacher_dtype: Literal["", "float32", "bfloat16", "float16"] = field(default="", metadata=_help(
        "the dtype the teacher sends its outputs in (default: its own)"))
    export_dtype: ExportDtype = field(default="bfloat16", metadata=_help(
        "dtype of the exported draft (OUTPUT_DIR/draft); checkpoints keep the training dtype"))
    max_steps: int = _as_in_train("max_steps")
    epochs: int = _as_in_train("epochs")
    batch_size: int = field(default=1, metadata=TrainConfig.__dataclass_fields__["batch_size"].metadata)
    grad_accum: int = _as_in_train("grad_accum")
    lr: float = field(default=1e-4, metadata=TrainConfig.__dataclass_fields__["lr"].metadata)
    weight_decay: float = _as_in_train("weight_decay")
    warmup_steps: int = _as_in_train("warmup_steps")
    schedule: Literal["cosine", "linear", "constant"] = _as_in_train("schedule")
    max_grad_norm: float = field(default=0.5, metadata=TrainConfig.__dataclass_fields__["max_grad_norm"].metadata)
    seq_len: int = field(default=2048, metadata=TrainConfig.__dataclass_fields__["seq_len"].metadata)
    pack_mode: PackMode = _as_in_train("pack_mode")
    bf16: bool = field(default=False, metadata=_help(
        "bf16 for the draft: on CUDA bf16 weights with float32 master weights in the optimizer "
        "(student_trainer/eagle3/precision.py); elsewhere bf16 autocast over float32 weights"))
    compile: Literal["auto", "on", "off"] = field(default="auto", metadata=_help(
        "torch.compile of the draft layer's elementwise work and of the loss chunks (fewer passes over "
        "[tokens, hidden] and [tokens, draft vocabulary]; on an H200 a 2k-token step ran at 52%% of the bf16 peak "
        "instead of 43%%; docs/eagle3.md); auto: on CUDA, off elsewhere"))
    prefetch: int = _as_in_train("prefetch")
    save_every: int = _as_in_train("save_every")
    log_every: int = _as_in_train("log_every")
    resume: bool = _as_in_train("resume")
    stop_after_steps: int = _as_in_train("stop_after_steps")
    seed: int = field(default=0, metadata=_help("seed of the data order and the draft's initial weights"))
    device: str = _as_in_train("device")
    skip_bad_lines: bool = _as_in_train("skip_bad_lines")
    teacher_timeout_s: float = _as_in_train("teacher_timeout_s")
    teacher_reconnect_timeout_s: float = _as_in_train("teacher_reconnect_timeout_s")
    teacher_max_resubmits: int = _as_in_train("teacher_max_resubmits")
    teacher_weight: float = _as_in_train("teacher_weight")
    refuse_fp8_teacher: bool = _as_in_train("refuse_fp8_teacher")
    max_teacher_kl: float = _as_in_train("max_teacher_kl")
    job_id: str = _as_in_train("job_id")
    teacher_tls_ca: str = _as_in_train("teacher_tls_ca")
    teacher_tls_cert: str = _as_in_train("teacher_tls_cert")
    teacher_tls_key: str = _as_in_train("teacher_tls_key")
    log_level: str = _as_in_train("log_level")

    def __post_init__(self) -> None:
        self.aux_layers = IntTuple(self.aux_layers)
        check_choices(self)
        check_max_teacher_kl(self.max_teacher_kl)
        for name in ("target_model", "data"):
            if not getattr(self, name):
                raise ConfigError(f"{flag(name)} is required")
        if not self.teacher and not self.teacher_outputs:
            raise ConfigError("--teacher HOST:PORT (or --teacher-outputs DIR) is required")
        if self.max_steps < 0 or (self.max_steps == 0 and self.epochs < 1):
            raise ConfigError("give --max-steps N (> 0) or --epochs N (>= 1)")
        for name in ("batch_size", "grad_accum", "seq_len", "draft_vocab_size", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.seq_len < self.ttt_steps + 2:
            raise ConfigError(f"--seq-len {self.seq_len} leaves nothing for step {self.ttt_steps} of the unroll to "
                              f"predict: use at least --ttt-steps + 2 = {self.ttt_steps + 2}")
        if self.aux_layers and len(self.aux_layers) != 3:
            raise ConfigError(f"--aux-layers {','.join(map(str, self.aux_layers))}: name exactly three layers "
                              "(low, middle, high), or leave it out for the teacher's default")
        if not 0 < self.step_decay <= 1:
            raise ConfigError(f"--step-decay {self.step_decay} must lie in (0, 1]")
        if self.intermediate_size < 0:
            raise ConfigError("--intermediate-size must be >= 0 (0: the target's)")
        if self.prefetch < 0:
            raise ConfigError("--prefetch must be >= 0")
        if not self.teacher_weight > 0:
            raise ConfigError("--teacher-weight must be > 0 (this job's share of the teacher against other jobs)")
        TrainConfig._check_teacher_connection(self)

    teacher_tls = TrainConfig.teacher_tls


@dataclass
class Eagle3EvalConfig:
    teacher: str = field(metadata=_help("the teacher server's gRPC address, HOST:PORT (serving the draft's target)"))
    draft: str = field(metadata=_help("the draft directory (OUTPUT_DIR/draft of `student-trainer eagle3`)"))
    data: str = field(metadata=_help(
        "held-out JSONL: prompts are a text record's first --prompt-tokens tokens, or a prompt or conversation up "
        "to where the loss mask starts"))
    tokenizer: str = field(default="", metadata=_help("default: the one saved with --draft"))
    steps: int = field(default=7, metadata=_help("K: proposals the draft makes per teacher forward"))
    prompts: int = field(default=16, metadata=_help("held-out prompts decoded"))
    prompt_tokens: int = field(default=64, metadata=_help("most tokens of a prompt (its last ones)"))
    new_tokens: int = field(default=64, metadata=_help("tokens generated after each prompt"))
    output: str = field(default="", metadata=_help("also write the figures as JSON to this file"))
    device: str = field(default="", metadata=_help("default: cuda if available, else cpu"))
    teacher_timeout_s: float = _as_in_train("teacher_timeout_s")
    teacher_reconnect_timeout_s: float = _as_in_train("teacher_reconnect_timeout_s")
    teacher_max_resubmits: int = _as_in_train("teacher_max_resubmits")
    refuse_fp8_teacher: bool = _as_in_train("refuse_fp8_teacher")
    max_teacher_kl: float = _as_in_train("max_teacher_kl")
    teacher_tls_ca: str = _as_in_train("teacher_tls_ca")
    teacher_tls_cert: str = _as_in_train("teacher_tls_cert")
    teacher_tls_key: str = _as_in_train("teacher_tls_key")
    log_level: str = _as_in_train("log_level")

    def __post_init__(self) -> None:
        check_max_teacher_kl(self.max_teacher_kl)
        for name in ("teacher", "draft", "data"):
            if not getattr(self, name):
                raise ConfigError(f"{flag(name)} is required")
        for name in ("steps", "prompts", "prompt_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        TrainConfig._check_teacher_connection(self)

    teacher_tls = TrainConfig.teacher_tls

