"""The trainer's settings: one dataclass, checked once, errors that name the flag."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

from student_trainer.losses import HIDDEN_LOSS_KINDS, LOSS_KINDS

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    teacher: str = ""
    model: str = ""
    data: str = ""
    output_dir: str = "runs/student"
    tokenizer: str = ""  # default: the --model directory
    eval_data: str = ""
    max_steps: int = 0  # 0: run --epochs
    epochs: int = 1
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    seq_len: int = 512
    pack_mode: str = "pack"
    loss: str = "forward_kl"
    jsd_beta: float = 0.5
    temperature: float = 1.0
    kd_weight: float = 0.5
    topk: int = 0
    hidden_layers: tuple = ()
    hidden_weight: float = 0.0
    hidden_loss: str = "mse"
    kd_chunk_tokens: int = 1024
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    compile: bool = False
    bf16: bool = False
    grad_checkpointing: bool = False
    prefetch: int = 2
    save_every: int = 0
    eval_every: int = 0
    log_every: int = 1
    resume: bool = False
    stop_after_steps: int = 0
    seed: int = 0
    device: str = ""  # default: cuda:LOCAL_RANK when CUDA is available, else cpu
    skip_bad_lines: bool = False
    teacher_timeout_s: float = 600.0
    teacher_reconnect_timeout_s: float = 300.0
    teacher_weight: float = 1.0
    job_id: str = ""
    teacher_tls_ca: str = ""  # a PEM path, or "system" for the system's roots; empty: plaintext
    teacher_tls_cert: str = ""
    teacher_tls_key: str = ""

    def __post_init__(self) -> None:
        self.hidden_layers = tuple(int(x) for x in self.hidden_layers)
        for flag in ("model", "data"):
            if not getattr(self, flag):
                raise ValueError(f"--{flag} is required")
        if not self.teacher and self.needs_teacher:
            raise ValueError("--teacher HOST:PORT is required (only --kd-weight 0 without --hidden-layers, "
                             "plain cross-entropy, runs without one)")
        if self.max_steps < 0 or (self.max_steps == 0 and self.epochs < 1):
            raise ValueError("give --max-steps N (> 0) or --epochs N (>= 1)")
        for flag in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"--loss {self.loss!r}: use one of {', '.join(LOSS_KINDS)}")
        if self.hidden_loss not in HIDDEN_LOSS_KINDS:
            raise ValueError(f"--hidden-loss {self.hidden_loss!r}: use one of {', '.join(HIDDEN_LOSS_KINDS)}")
        if self.loss == "jsd" and not 0 < self.jsd_beta < 1:
            raise ValueError(f"--jsd-beta {self.jsd_beta} must lie in (0, 1); for 0 or 1 use --loss forward_kl "
                             "or reverse_kl")
        if self.temperature <= 0:
            raise ValueError("--temperature must be > 0")
        if not 0 <= self.kd_weight <= 1:
            raise ValueError(f"--kd-weight {self.kd_weight} must lie in [0, 1] (alpha in alpha*KD + (1-alpha)*CE)")
        if self.topk < 0:
            raise ValueError("--topk must be >= 0 (0: distil from full logits)")
        if self.hidden_weight < 0 or (self.hidden_weight > 0 and not self.hidden_layers):
            raise ValueError("--hidden-weight > 0 needs --hidden-layers (teacher layers to match)")
        if self.hidden_layers and self.hidden_weight == 0:
            raise ValueError("--hidden-layers needs --hidden-weight > 0")
        if self.kd_weight == 0 and not self.hidden_weight:
            log.warning("--kd-weight 0 and no hidden-state loss: this is plain cross-entropy training")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"--schedule {self.schedule!r}: use cosine, linear or constant")
        if self.pack_mode not in ("pack", "truncate"):
            raise ValueError(f"--pack-mode {self.pack_mode!r}: use pack or truncate")
        if self.prefetch < 0:
            raise ValueError("--prefetch must be >= 0")
        if not self.teacher_weight > 0:
            raise ValueError("--teacher-weight must be > 0 (this job's share of the teacher against other jobs)")
        if self.teacher_reconnect_timeout_s < 0:
            raise ValueError("--teacher-reconnect-timeout-s must be >= 0 (0: fail at once when the teacher goes away)")
        if self.lora_r < 0:
            raise ValueError("--lora-r must be >= 0 (0: full fine-tuning)")
        self._check_tls()

    def _check_tls(self) -> None:
        from distill_common.channel import TlsFlags, channel_credentials

        # Builds the credentials once so a missing file or a lone --teacher-tls-cert fails here, by flag name.
        channel_credentials(self.teacher_tls, self.teacher_tls_cert, self.teacher_tls_key,
                            TlsFlags(ca="--teacher-tls-ca", cert="--teacher-tls-cert", key="--teacher-tls-key"))

    @property
    def teacher_tls(self) -> str | bool | None:
        """TeacherClient's tls_ca: a path, True (system roots) or None (plaintext)."""
        from distill_common.channel import tls_ca_arg  # grpc: only when a teacher is used

        return tls_ca_arg(self.teacher_tls_ca)

    @property
    def uses_logits(self) -> bool:
        return self.kd_weight > 0

    @property
    def needs_teacher(self) -> bool:
        return self.uses_logits or bool(self.hidden_layers)

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        d = cls.__dataclass_fields__
        p.add_argument("--teacher", default="", help="the teacher server's gRPC address, HOST:PORT")
        p.add_argument("--model", required=True,
                       help="the student: a HF directory, a hub id, builtin:NAME or random:CONFIG_DIR")
        p.add_argument("--data", required=True, help="JSONL: {text}, {prompt, completion} or {messages}")
        p.add_argument("--output-dir", default=d["output_dir"].default)
        p.add_argument("--tokenizer", default="", help="default: the --model directory")
        p.add_argument("--eval-data", default="", help="JSONL scored with --eval-every (CE and KD on held-out data)")
        p.add_argument("--max-steps", type=int, default=0, help="optimizer steps (0: run --epochs)")
        p.add_argument("--epochs", type=int, default=1)
        p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
        p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
        p.add_argument("--lr", type=float, default=3e-4)
        p.add_argument("--weight-decay", type=float, default=0.0)
        p.add_argument("--warmup-steps", type=int, default=0)
        p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"],
                       help="decay after warmup")
        p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
        p.add_argument("--seq-len", type=int, default=512)
        p.add_argument("--pack-mode", default="pack", choices=["pack", "truncate"])
        p.add_argument("--loss", default="forward_kl", choices=list(LOSS_KINDS))
        p.add_argument("--jsd-beta", type=float, default=0.5, help="teacher weight in generalized JSD")
        p.add_argument("--temperature", type=float, default=1.0)
        p.add_argument("--kd-weight", type=float, default=0.5, help="alpha in alpha*KD + (1-alpha)*CE")
        p.add_argument("--topk", type=int, default=0, help="distil from the teacher's top-k logits (0: full logits)")
        p.add_argument("--hidden-layers", default="",
                       help="comma-separated teacher layers whose hidden states the student matches")
        p.add_argument("--hidden-weight", type=float, default=0.0)
        p.add_argument("--hidden-loss", default="mse", choices=list(HIDDEN_LOSS_KINDS))
        p.add_argument("--kd-chunk-tokens", type=int, default=1024,
                       help="tokens per chunk of the KD loss (memory: ~5 x 4 B x chunk x vocab)")
        p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (needs peft; 0: full fine-tuning)")
        p.add_argument("--lora-alpha", type=int, default=16)
        p.add_argument("--lora-dropout", type=float, default=0.0)
        p.add_argument("--lora-target-modules", default="all-linear")
        p.add_argument("--compile", action="store_true", help="torch.compile the student")
        p.add_argument("--bf16", action="store_true", help="bf16 autocast for the student's forward")
        p.add_argument("--grad-checkpointing", action="store_true")
        p.add_argument("--prefetch", type=int, default=2,
                       help="micro-batches submitted to the teacher ahead of the one training")
        p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
        p.add_argument("--eval-every", type=int, default=0)
        p.add_argument("--log-every", type=int, default=1)
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
        p.add_argument("--stop-after-steps", type=int, default=0,
                       help="checkpoint and stop after N steps of this run (continue later with --resume), "
                            "e.g. to fit a scheduler's time limit")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="", help="default: cuda:LOCAL_RANK if CUDA is available, else cpu")
        p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed JSONL lines")
        p.add_argument("--teacher-timeout-s", type=float, default=600.0,
                       help="how long to wait for one batch of teacher outputs")
        p.add_argument("--teacher-reconnect-timeout-s", type=float, default=300.0,
                       help="when the teacher goes away (restart, crash), keep trying to join it again this long, "
                            "then fail; batches not yet received are submitted again (0: fail at once)")
        p.add_argument("--job-id", default="", help="shown in the teacher's status (default: the run directory)")
        p.add_argument("--teacher-weight", type=float, default=1.0,
                       help="this job's share of a busy teacher relative to other jobs (every rank gives the same)")
        p.add_argument("--teacher-tls-ca", default="",
                       help="talk TLS to a teacher started with --tls-cert: the PEM CA that signed its certificate, "
                            "or 'system' for the system's roots (default: plaintext)")
        p.add_argument("--teacher-tls-cert", default="",
                       help="this job's client certificate (PEM), for a teacher started with --tls-client-ca")
        p.add_argument("--teacher-tls-key", default="", help="the key of --teacher-tls-cert (PEM)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if isinstance(values.get("hidden_layers"), str):
            values["hidden_layers"] = tuple(int(x) for x in values["hidden_layers"].split(",") if x.strip())
        return cls(**values)

    def non_defaults(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default and f.name not in ("teacher", "model", "data")}
