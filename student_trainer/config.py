"""The trainer's settings: one dataclass, checked once, errors that name the flag.

`student-trainer train` generates its command line from these fields
(distill_common/settings.py): a field's help text is its flag's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from distill_common import wire
from distill_common.settings import LOG_LEVELS, ConfigError, IntTuple, Repeated, check_choices, flag, repeated
from student_trainer.data import PackMode
from student_trainer.losses import (CROSS_TOKENIZER_LOSS_KINDS, CrossTokenizerLossKind, HiddenLossKind, LossKind,
                                    TopKTail, check_options, check_relation_options, check_topk_tail)

# --loss: a divergence between two distributions over one vocabulary, or a loss across tokenizers.
TrainLossKind = Literal[LossKind, CrossTokenizerLossKind]


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class TrainConfig:
    model: str = field(metadata=_help("the student: a HF directory, a hub id, builtin:NAME or random:CONFIG_DIR"))
    data: str = field(metadata=_help("JSONL: {text}, {prompt, completion} or {messages}"))
    teacher: str = field(default="", metadata=_help(
        "the teacher server's gRPC address, HOST:PORT, or a pool of replicas: a comma list, dns:NAME:PORT or "
        "file:PATH (docs/scaling.md); needed unless --kd-weight 0 without --hidden-layers, or --teacher-outputs"))
    teacher_outputs: str = field(default="", metadata=_help(
        "read the teacher's outputs from this store (student-trainer dump) instead of a live teacher; with "
        "--teacher too, what the store lacks is asked of the teacher and written into it"))
    teacher_spec: Repeated = repeated(
        "one of several teachers, given once per teacher: name=NAME,address=HOST:PORT (or store=DIR) and optional "
        "weight=W (its loss weight), temperature=T, kind=logits|topk|head|gold|uld, topk=K, tail=bucket|none, "
        "loss=forward_kl|reverse_kl|jsd, cross_topk=K, cross_match=exact|prefix, share=W (this job's share of it); "
        "keys left out take the flags of the same name (docs/training.md#several-teachers)", "SPEC")
    teachers: str = field(default="", metadata=_help(
        "a JSON file listing several teachers, [{\"name\": ..., \"address\": ...}, ...], with the keys of "
        "--teacher-spec"))
    teacher_combine: Literal["sum", "mixture"] = field(default="sum", metadata=_help(
        "several teachers scoring every example: sum, the weighted mean of each teacher's divergence; mixture, the "
        "divergence to the weighted mixture of their distributions (docs/training.md#several-teachers)"))
    teacher_route: str = field(default="all", metadata=_help(
        "several teachers: all (each scores every example) or field:NAME (each example names its one teacher in "
        "its JSON field NAME; a teacher is sent only the rows holding its examples' tokens)"))
    output_dir: str = field(default="runs/student", metadata=_help(
        "checkpoints, metrics.jsonl and the final model"))
    tokenizer: str = field(default="", metadata=_help("default: the --model directory"))
    eval_data: str = field(default="", metadata=_help(
        "JSONL scored every --eval-every steps: CE, and KD against the teacher when --kd-weight > 0"))
    max_steps: int = field(default=0, metadata=_help("optimizer steps (0: run --epochs)"))
    epochs: int = field(default=1, metadata=_help("passes over --data, when --max-steps is 0"))
    batch_size: int = field(default=8, metadata=_help("sequences per micro-batch per rank"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    lr: float = field(default=3e-4, metadata=_help("peak learning rate (AdamW)"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    warmup_steps: int = field(default=0, metadata=_help("steps of linear warmup to --lr"))
    schedule: Literal["cosine", "linear", "constant"] = field(default="cosine", metadata=_help("decay after warmup"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping (0: off)"))
    seq_len: int = field(default=512, metadata=_help("tokens per training sequence"))
    pack_mode: PackMode = field(default="pack", metadata=_help(
        "pack: concatenate examples into full sequences; truncate: one example per sequence, cut at --seq-len"))
    loss: TrainLossKind = field(default="forward_kl", metadata=_help(
        "the KD loss: forward_kl KL(teacher || student), reverse_kl KL(student || teacher), jsd generalized JSD "
        "(the student shares the teacher's tokenizer); gold (direct KL on the vocabulary entries both tokenizers "
        "spell alike, sorted L1 on the rest) or uld (sorted L1 on the top --cross-topk) for a student with another "
        "tokenizer: the teacher re-tokenizes its text and aligns the two (docs/training.md)"))
    cross_topk: int = field(default=8, metadata=_help(
        "--loss gold: the unmatched rest's k largest probabilities compared sorted (0: its mass alone); --loss uld: "
        "the k largest probabilities compared sorted"))
    cross_match: Literal["exact", "prefix"] = field(default="exact", metadata=_help(
        "--loss gold: which student entry a teacher entry's probability goes to: exact, the one spelling the same "
        "bytes (GOLD's rule; the rest is unmatched); prefix, the one whose bytes are the longest prefix of the "
        "teacher's (keeps the mass of teacher tokens longer than the student's)"))
    jsd_beta: float = field(default=0.5, metadata=_help("teacher weight in generalized JSD (--loss jsd)"))
    temperature: float = field(default=1.0, metadata=_help("softmax temperature of the KD loss"))
    kd_weight: float = field(default=0.5, metadata=_help("alpha in alpha*KD + (1-alpha)*CE"))
    ce_weight: float | None = field(default=None, metadata=_help(
        "weight of the cross-entropy term (default: 1 - --kd-weight); 0 skips it"))
    topk: int = field(default=0, metadata=_help(
        "distil from the teacher's k most likely tokens and their log-probabilities (0: full logits)"))
    topk_tail: TopKTail = field(default="bucket", metadata=_help(
        "with --topk, the teacher's mass outside its k tokens: bucket, one outcome against the student's own "
        "(exact); none, both sides renormalised over the k"))
    head_on_student: bool = field(default=False, metadata=_help(
        "receive the teacher's final hidden state, and its output head once at join, instead of its logits: the KD "
        "loss computes the teacher's logits chunk by chunk (vocab/hidden times fewer bytes per token; with --topk, "
        "compared on the top k of those)"))
    hidden_layers: IntTuple = field(default=(), metadata=_help(
        "comma-separated teacher layers whose hidden states the student matches"))
    hidden_weight: float = field(default=0.0, metadata=_help("weight of the hidden-state loss"))
    hidden_loss: HiddenLossKind = field(default="mse", metadata=_help("the hidden-state loss"))
    attention_layers: IntTuple = field(default=(), metadata=_help(
        "comma-separated teacher decoder layers (0-based) whose attention inputs (queries, keys, values) the "
        "student's layer at the same relative depth matches through MiniLMv2 relations"))
    attention_weight: float = field(default=0.0, metadata=_help("weight of the attention-relation loss"))
    attention_relation_heads: int = field(default=8, metadata=_help(
        "heads the q, k and v of both models are split into for their relations; must divide every q, k and v "
        "width of both"))
    attention_block_rows: int = field(default=256, metadata=_help(
        "query rows per block of the attention loss (memory: ~4 x 4 B x batch x heads x block x seq)"))
    kd_chunk_tokens: int = field(default=1024, metadata=_help(
        "tokens per chunk of the KD loss (memory: ~5 x 4 B x chunk x vocab)"))
    # On-policy distillation (student_trainer/onpolicy.py, docs/training.md).
    on_policy_fraction: float | None = field(default=None, metadata={"metavar": "LAMBDA", "help": (
        "on-policy distillation (GKD): the share of batches whose completions the student samples from the "
        "data's prompts, the others keeping the data's completions (1: fully on-policy, 0: never sampled); "
        "--data then holds {prompt, completion} or {messages} records (default: off, plain distillation)")})
    on_policy_loss: Literal["sampled", "divergence"] = field(default="sampled", metadata=_help(
        "the loss on sampled completions: sampled, the per-token reverse KL on the sampled tokens from the "
        "teacher's log-probability of each; divergence, --loss on the support --student-topk says"))
    student_topk: int = field(default=0, metadata=_help(
        "on-policy: --loss is computed on the student's own top K ids and the rest, which the teacher scores "
        "exactly (0: on the teacher's full logits)"))
    sample_temperature: float = field(default=1.0, metadata=_help("on-policy: the temperature of sampling"))
    top_p: float = field(default=1.0, metadata=_help("on-policy: nucleus sampling's mass (1: off)"))
    max_new_tokens: int = field(default=64, metadata=_help(
        "on-policy: the longest sampled completion (prompts must leave this many of --seq-len)"))
    stop_tokens: str = field(default="", metadata=_help(
        "on-policy: comma-separated tokens that end a sample besides eos and the chat template's end of turn"))
    lora_r: int = field(default=0, metadata=_help("LoRA rank (needs peft; 0: full fine-tuning)"))
    lora_alpha: int = field(default=16, metadata=_help("LoRA alpha"))
    lora_dropout: float = field(default=0.0, metadata=_help("LoRA dropout"))
    lora_target_modules: str = field(default="all-linear", metadata=_help(
        "comma-separated module names LoRA adapts, or all-linear"))
    compile: bool = field(default=False, metadata=_help("torch.compile the student"))
    bf16: bool = field(default=False, metadata=_help(
        "bf16 autocast for the student's forward (with --lora-r, the frozen base weights are held in bf16 too)"))
    grad_checkpointing: bool = field(default=False, metadata=_help("gradient checkpointing in the student"))
    prefetch: int = field(default=2, metadata=_help(
        "micro-batches submitted to the teacher ahead of the one training"))
    save_every: int = field(default=0, metadata=_help("checkpoint every N steps (0: only at the end)"))
    eval_every: int = field(default=0, metadata=_help(
        "score --eval-data every N steps and at the last step (0: never)"))
    log_every: int = field(default=1, metadata=_help("write metrics.jsonl every N steps"))
    resume: bool = field(default=False, metadata=_help("continue from the latest checkpoint in --output-dir"))
    stop_after_steps: int = field(default=0, metadata=_help(
        "checkpoint and stop after N steps of this run (continue later with --resume), e.g. to fit a scheduler's "
        "time limit"))
    seed: int = field(default=0, metadata=_help(
        "seed of the data order, the student's RNG and a random: or builtin: student's initial weights "
        "(a builtin: one at seed 0 is the built-in teacher of that name)"))
    device: str = field(default="", metadata=_help("default: cuda:LOCAL_RANK if CUDA is available, else cpu"))
    skip_bad_lines: bool = field(default=False, metadata=_help("skip and count malformed JSONL lines"))
    teacher_timeout_s: float = field(default=600.0, metadata=_help(
        "how long to wait for one batch of teacher outputs"))
    teacher_reconnect_timeout_s: float = field(default=300.0, metadata=_help(
        "when the teacher goes away (restart, crash), keep trying to join it again this long, then fail; batches "
        "not yet received are submitted again (0: fail at once)"))
    # TeacherClient's own default (student_trainer/connection.py: MAX_RESUBMITS).
    teacher_max_resubmits: int = field(default=3, metadata=_help(
        "when the teacher ended the session holding a batch, send the batch again this many times at most; then "
        "the run stops with BatchNotServed, which says why each session ended"))
    teacher_weight: float = field(default=1.0, metadata=_help(
        "this job's share of a busy teacher relative to other jobs (every rank gives the same)"))
    refuse_fp8_teacher: bool = field(default=False, metadata=_help(
        "refuse, at join, a teacher whose decoder runs in FP8 (its --quantize fp8, or an FP8 checkpoint): the KL "
        "it adds to the distribution is in docs/performance.md (default: accept it; the log says what it runs in)"))
    max_teacher_kl: float = field(default=0.0, metadata=_help(
        "refuse, at join, a teacher in FP8 whose start-up measurement of what FP8 costs it (KL to its own dtype, "
        "nats per token, TeacherInfo.quantization) is above this, or that measured nothing (a published FP8 "
        "checkpoint, tensor parallelism); a teacher in its dtype always passes (0: no bound)"))
    teacher_dtype: str = field(default="", metadata=_help(
        "the dtype the teacher sends its outputs in: float32, bfloat16 or float16 (default: the teacher's)"))
    job_id: str = field(default="", metadata=_help("shown in the teacher's status (default: the run directory)"))
    teacher_tls_ca: str = field(default="", metadata=_help(
        "talk TLS to a teacher started with --tls-cert: the PEM CA that signed its certificate, or 'system' for "
        "the system's roots (default: plaintext)"))
    teacher_tls_cert: str = field(default="", metadata=_help(
        "this job's client certificate (PEM), for a teacher started with --tls-client-ca"))
    teacher_tls_key: str = field(default="", metadata=_help("the key of --teacher-tls-cert (PEM)"))
    log_level: str = field(default="INFO", metadata=_help(
        "rank 0's logging level (other ranks log warnings and errors only)"))

    # The teachers of --teacher-spec and --teachers, resolved against the flags (student_trainer/teachers.py).
    teacher_plans: tuple = field(init=False, default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.hidden_layers = IntTuple(self.hidden_layers)
        self.teacher_spec = list(self.teacher_spec)
        check_choices(self)
        check_max_teacher_kl(self.max_teacher_kl)
        for name in ("model", "data"):
            if not getattr(self, name):
                raise ConfigError(f"{flag(name)} is required")
        several = bool(self.teacher_spec or self.teachers)
        if not several and (self.teacher_combine != "sum" or self.teacher_route != "all"):
            raise ConfigError("--teacher-combine and --teacher-route go with several teachers (--teacher-spec, "
                              "--teachers)")
        if not self.teacher and not self.teacher_outputs and not several and self.needs_teacher:
            raise ConfigError("--teacher HOST:PORT (or --teacher-outputs DIR) is required (only --kd-weight 0 "
                              "without --hidden-layers and --attention-layers, plain cross-entropy, runs without one)")
        if self.teacher_outputs and not self.teacher and self.eval_data and self.uses_logits:
            raise ConfigError("--eval-data scores KD against the teacher's outputs of the held-out data, which "
                              "--teacher-outputs does not hold: give --teacher too, or leave out --eval-data")
        if self.teacher_outputs and self.on_policy:
            raise ConfigError("--teacher-outputs holds outputs for the data's own tokens; on-policy training "
                              "(--on-policy-fraction) samples new completions each step: use --teacher")
        if self.max_steps < 0 or (self.max_steps == 0 and self.epochs < 1):
            raise ConfigError("give --max-steps N (> 0) or --epochs N (>= 1)")
        for name in ("batch_size", "grad_accum", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.cross_tokenizer:
            self._check_cross_tokenizer()
        else:
            check_options(self.loss, self.temperature, self.jsd_beta, self.kd_chunk_tokens)
        if not 0 <= self.kd_weight <= 1:
            raise ConfigError(f"--kd-weight {self.kd_weight} must lie in [0, 1] (alpha in alpha*KD + (1-alpha)*CE)")
        if self.topk < 0:
            raise ConfigError("--topk must be >= 0 (0: distil from full logits)")
        check_topk_tail(self.topk_tail)
        if self.hidden_weight < 0 or (self.hidden_weight > 0 and not self.hidden_layers):
            raise ConfigError("--hidden-weight > 0 needs --hidden-layers (teacher layers to match)")
        if self.hidden_layers and self.hidden_weight == 0:
            raise ConfigError("--hidden-layers needs --hidden-weight > 0")
        self.attention_layers = IntTuple(self.attention_layers)
        if self.attention_weight < 0 or (self.attention_weight > 0 and not self.attention_layers):
            raise ConfigError("--attention-weight > 0 needs --attention-layers (teacher layers to match)")
        if self.attention_layers and self.attention_weight == 0:
            raise ConfigError("--attention-layers needs --attention-weight > 0")
        check_relation_options(self.attention_relation_heads, self.attention_block_rows)
        if self.ce_weight is not None and self.ce_weight < 0:
            raise ConfigError(f"--ce-weight {self.ce_weight} must be >= 0")
        if self.head_on_student and not self.uses_logits:
            raise ConfigError("--head-on-student applies the teacher's output head for the KD loss: it needs "
                              "--kd-weight > 0")
        if self.prefetch < 0:
            raise ConfigError("--prefetch must be >= 0")
        if not self.teacher_weight > 0:
            raise ConfigError("--teacher-weight must be > 0 (this job's share of the teacher against other jobs)")
        if self.teacher_dtype:
            try:
                wire.parse_output_dtype(self.teacher_dtype)
            except wire.WireError as e:
                raise ConfigError(f"--teacher-dtype: {e}") from None
        if self.lora_r < 0:
            raise ConfigError("--lora-r must be >= 0 (0: full fine-tuning)")
        self._check_on_policy()
        self._check_teacher_connection()
        if several:
            self._check_several_teachers()

    def _check_several_teachers(self) -> None:
        from student_trainer.teachers import plan_teachers, read_teacher_specs, route_field

        if self.teacher or self.teacher_outputs:
            raise ConfigError("--teacher-spec / --teachers name every teacher (address= or store= each): leave out "
                              "--teacher and --teacher-outputs")
        if not self.uses_logits:
            raise ConfigError("several teachers distil logits: give --kd-weight > 0")
        if self.hidden_layers or self.attention_layers:
            raise ConfigError("--hidden-layers and --attention-layers match one teacher's layers: with several "
                              "teachers, leave them out")
        field_name = route_field(self.teacher_route)
        if field_name and self.on_policy:
            raise ConfigError("--teacher-route field:NAME routes the data's examples; on-policy training (its "
                              "prompts) asks every teacher: use --teacher-route all")
        if field_name and self.teacher_combine != "sum":
            raise ConfigError("--teacher-route field:NAME scores each token with one teacher, so there is nothing to "
                              "combine: leave out --teacher-combine")
        self.teacher_plans = plan_teachers(self, read_teacher_specs(self.teacher_spec, self.teachers))
        if not self.teacher_plans:
            raise ConfigError(f"--teachers {self.teachers}: the list is empty")
        stores_alone = [plan.name for plan in self.teacher_plans if not plan.address]
        if stores_alone and self.eval_data:
            raise ConfigError(f"--eval-data scores KD against each teacher, and teacher(s) {', '.join(stores_alone)} "
                              "have a store only: give them address= too, or leave out --eval-data")

    @property
    def several_teachers(self) -> bool:
        return bool(self.teacher_plans)

    def _check_cross_tokenizer(self) -> None:
        if not self.uses_logits:
            raise ConfigError(f"--loss {self.loss} is a KD loss: give --kd-weight > 0")
        if self.temperature != 1.0:
            raise ConfigError(f"--loss {self.loss} compares the teacher's probabilities at temperature 1: leave out "
                              "--temperature")
        if self.topk or self.head_on_student or self.hidden_layers or self.attention_layers or self.on_policy:
            raise ConfigError(f"--loss {self.loss} receives outputs shaped to the student's tokens, which leaves out "
                              "--topk, --head-on-student, --hidden-layers, --attention-layers and on-policy training "
                              "(all shaped to the teacher's tokens); use --cross-topk for the sorted probabilities")
        if self.cross_topk < (1 if self.loss == "uld" else 0):
            raise ConfigError(f"--cross-topk {self.cross_topk} must be >= 1 for --loss uld, >= 0 for --loss gold")
        if isinstance(self.kd_chunk_tokens, bool) or self.kd_chunk_tokens < 1:
            raise ConfigError(f"--kd-chunk-tokens must be >= 1, got {self.kd_chunk_tokens!r}")

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the KD loss is one for a student with another tokenizer (--loss gold or uld)."""
        return self.loss in CROSS_TOKENIZER_LOSS_KINDS

    def _check_on_policy(self) -> None:
        if not self.on_policy:
            if self.student_topk:
                raise ConfigError("--student-topk applies to on-policy training: give --on-policy-fraction too, or "
                                  "use --topk (the teacher's top k)")
            return
        if not 0 <= self.on_policy_fraction <= 1:
            raise ConfigError(f"--on-policy-fraction {self.on_policy_fraction} must lie in [0, 1]")
        if self.on_policy_fraction > 0 and not self.uses_logits:
            raise ConfigError("--on-policy-fraction > 0 needs the teacher: --kd-weight > 0 (sampled completions "
                              "have no reference to train on)")
        if self.hidden_layers or self.topk:
            raise ConfigError("on-policy training distils log-probabilities: leave out --hidden-layers and --topk "
                              "(--student-topk K scores the student's own top K)")
        if self.student_topk < 0:
            raise ConfigError("--student-topk must be >= 0 (0: the teacher's full logits)")
        if self.student_topk and self.on_policy_fraction == 1 and self.on_policy_loss == "sampled":
            raise ConfigError("--student-topk is the support of the --loss divergence, which no batch uses with "
                              "--on-policy-fraction 1 --on-policy-loss sampled: leave it out, or use "
                              "--on-policy-loss divergence")
        if not (self.sample_temperature > 0 and self.sample_temperature != float("inf")):
            raise ConfigError(f"--sample-temperature {self.sample_temperature} must be > 0 and finite: the "
                              "sampled-token loss needs the distribution samples come from")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p} must lie in (0, 1]")
        if not 1 <= self.max_new_tokens < self.seq_len:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens} must be >= 1 and leave room for a prompt "
                              f"in --seq-len {self.seq_len}")

    def _check_teacher_connection(self) -> None:
        """The settings every command that reaches a teacher shares (the trainer's, EAGLE-3's):
        reconnects, resubmits, the log level and TLS."""
        if self.teacher_reconnect_timeout_s < 0:
            raise ConfigError("--teacher-reconnect-timeout-s must be >= 0 (0: fail at once when the teacher goes "
                              "away)")
        if self.teacher_max_resubmits < 0:
            raise ConfigError("--teacher-max-resubmits must be >= 0 (0: a batch whose session ended fails at once)")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        TrainConfig._check_tls(self)  # called on the EAGLE-3 configs too, which have no method of that name

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
    def on_policy(self) -> bool:
        return self.on_policy_fraction is not None

    @property
    def uses_logits(self) -> bool:
        return self.kd_weight > 0

    @property
    def needs_teacher(self) -> bool:
        return self.uses_logits or bool(self.hidden_layers) or bool(self.attention_layers)

    @property
    def ce_factor(self) -> float:
        """The CE term's weight: --ce-weight, else 1 - --kd-weight."""
        return 1.0 - self.kd_weight if self.ce_weight is None else self.ce_weight


def check_max_teacher_kl(value: float) -> None:
    if not 0 <= value < float("inf"):
        raise ConfigError(f"--max-teacher-kl {value} must be a finite number >= 0 (nats per token; 0: no bound)")


def _as_in_train(name: str):
    """TrainConfig's field `name` (its default and help): the dump reads the data as training does."""
    original = TrainConfig.__dataclass_fields__[name]
    return field(default=original.default, metadata=original.metadata)


@dataclass
class DumpConfig:
    """`student-trainer dump`: the teacher's outputs for every example of --data, into a store."""

    data: str = field(metadata=_help("JSONL, as `train --data` reads it: the store's rows are its examples"))
    teacher_outputs: str = field(metadata=_help(
        "the store's directory (created; a dump there with the same settings is continued)"))
    teacher: str = field(default="", metadata=_help(
        "the teacher server's gRPC address, HOST:PORT (or --model: the teacher in this process)"))
    model: str = field(default="", metadata=_help(
        "a teacher loaded in this process: a HF directory, a hub id, builtin:NAME or random:CONFIG_DIR"))
    model_dtype: Literal["", "float32", "bfloat16", "float16"] = field(default="", metadata=_help(
        "--model's dtype (default: its own)"))
    tokenizer: str = field(default="", metadata=_help(
        "the tokenizer training uses (default: the --model directory; required with --teacher)"))
    seq_len: int = _as_in_train("seq_len")
    pack_mode: PackMode = _as_in_train("pack_mode")
    logits: bool = field(default=False, metadata=_help("store the full logits (what train reads without --topk)"))
    topk: int = field(default=0, metadata=_help("store the top-k logits (train --topk K)"))
    final_hidden: bool = field(default=False, metadata=_help(
        "store the final hidden state, and the output head once (train --head-on-student)"))
    hidden_layers: IntTuple = field(default=(), metadata=_help("store these layers' hidden states"))
    attention_layers: IntTuple = field(default=(), metadata=_help("store these layers' attention inputs"))
    next_token_logprobs: bool = field(default=False, metadata=_help(
        "store the log-probability of each next token (4 bytes a token)"))
    eagle3: bool = field(default=False, metadata=_help(
        "store what `student-trainer eagle3` reads: the three aux layers, the argmax and the final hidden state "
        "(with the head: the draft vocabulary's logits are computed from it when read)"))
    aux_layers: IntTuple = field(default=(), metadata=_help("with --eagle3: the three layers (default: the teacher's)"))
    dtype: Literal["", "float32", "bfloat16", "float16"] = field(default="", metadata=_help(
        "the dtype the outputs are stored in (default: the teacher's); bfloat16 or float16 halve float32's bytes"))
    raw_ids: bool = field(default=False, metadata=_help(
        "store ids as int32 (default: packed to the vocabulary's bits, 17 for 128k)"))
    zstd_level: int = field(default=0, metadata=_help(
        "compress each row with zstd at this level (0: off; needs the zstandard package)"))
    batch_size: int = field(default=8, metadata=_help("examples per teacher batch"))
    rows_per_shard: int = field(default=256, metadata=_help("examples per shard (a multiple of --batch-size)"))
    prefetch: int = field(default=2, metadata=_help("batches asked of the teacher ahead of the one written"))
    device: str = field(default="", metadata=_help("default: cuda:LOCAL_RANK if CUDA is available, else cpu"))
    skip_bad_lines: bool = _as_in_train("skip_bad_lines")
    teacher_timeout_s: float = _as_in_train("teacher_timeout_s")
    teacher_reconnect_timeout_s: float = _as_in_train("teacher_reconnect_timeout_s")
    teacher_max_resubmits: int = _as_in_train("teacher_max_resubmits")
    teacher_weight: float = _as_in_train("teacher_weight")
    refuse_fp8_teacher: bool = _as_in_train("refuse_fp8_teacher")
    max_teacher_kl: float = _as_in_train("max_teacher_kl")
    job_id: str = field(default="", metadata=_help("shown in the teacher's status (default: dump-DIRNAME)"))
    teacher_tls_ca: str = _as_in_train("teacher_tls_ca")
    teacher_tls_cert: str = _as_in_train("teacher_tls_cert")
    teacher_tls_key: str = _as_in_train("teacher_tls_key")
    log_level: str = _as_in_train("log_level")

    def __post_init__(self) -> None:
        self.hidden_layers = IntTuple(self.hidden_layers)
        self.attention_layers = IntTuple(self.attention_layers)
        self.aux_layers = IntTuple(self.aux_layers)
        check_choices(self)
        check_max_teacher_kl(self.max_teacher_kl)
        for name in ("data", "teacher_outputs"):
            if not getattr(self, name):
                raise ConfigError(f"{flag(name)} is required")
        if bool(self.teacher) == bool(self.model):
            raise ConfigError("give --teacher HOST:PORT (a served teacher) or --model (one loaded here), one of them")
        if self.teacher and not self.tokenizer:
            raise ConfigError("--teacher needs --tokenizer: the tokenizer training uses, so the rows match its batches")
        for name in ("seq_len", "batch_size", "rows_per_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag(name)} must be >= 1")
        if self.rows_per_shard % self.batch_size:
            raise ConfigError(f"--rows-per-shard {self.rows_per_shard} must be a multiple of --batch-size "
                              f"{self.batch_size} (a batch never spans two shards)")
        if self.topk < 0 or self.zstd_level < 0 or self.prefetch < 0:
            raise ConfigError("--topk, --zstd-level and --prefetch must be >= 0")
        if self.aux_layers and not self.eagle3:
            raise ConfigError("--aux-layers goes with --eagle3")
        if self.aux_layers and len(self.aux_layers) != 3:
            raise ConfigError("--aux-layers: name exactly three layers, or leave it out for the teacher's default")
        if not self.outputs():
            raise ConfigError("store something: --logits, --topk K, --final-hidden, --hidden-layers, "
                              "--attention-layers, --next-token-logprobs or --eagle3")
        if self.zstd_level:
            from distill_common.store import StoreError, zstd_module

            try:
                zstd_module()
            except StoreError as e:
                raise ConfigError(f"--zstd-level: {e}") from None
        TrainConfig._check_teacher_connection(self)

    teacher_tls = TrainConfig.teacher_tls

    def outputs(self) -> tuple:
        """The kinds stored, as the trainer asks them (student_trainer/train.py: teacher_outputs)."""
        from distill_common.outputs import (Argmax, AttentionInputs, AuxHiddenStates, FinalHidden, HiddenStates,
                                            Logits, NextTokenLogprobs, TopK)

        kinds = [Logits()] if self.logits else []
        kinds += [TopK(self.topk)] if self.topk else []
        kinds += [FinalHidden()] if self.final_hidden or self.eagle3 else []
        kinds += [HiddenStates(self.hidden_layers)] if self.hidden_layers else []
        kinds += [AttentionInputs(self.attention_layers)] if self.attention_layers else []
        kinds += [NextTokenLogprobs()] if self.next_token_logprobs else []
        kinds += [AuxHiddenStates(self.aux_layers), Argmax()] if self.eagle3 else []
        return tuple(kinds)
