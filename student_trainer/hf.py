"""Distillation from a remote teacher inside a Hugging Face `transformers.Trainer` script.

    trainer = DistillationTrainer(model=student, args=training_args, train_dataset=ds,
                                  processing_class=tokenizer, teacher_address="teacher-host:50051",
                                  kd_weight=0.5)
    trainer.train()

The loss of a micro-batch is ``kd_weight * KD + (1 - kd_weight) * CE (+ attention_weight *
attention)``: CE is the model's own loss from ``labels``; KD compares the student's next-token
distributions with the teacher's (``student_trainer.losses``) at the positions whose next-token
label is not -100, the same positions CE counts. Position t predicts token t + 1, so
logits[:, :-1] meet labels[:, 1:]. ``head_on_student`` asks the teacher for its final hidden
state and applies its output head (received once, at join) chunk by chunk inside the KD loss.
The attention term (``attention_layers``) compares MiniLMv2 relations of the student's
queries, keys and values with the teacher's layers at the same relative depth, over the real
tokens (``attention_mask``).

Several teachers (``teachers=[{"name": "code", "address": "host:50051", "weight": 2}, ...]``, the
keys of ``--teacher-spec``, docs/training.md#several-teachers): each is its own session (or
store), every micro-batch is submitted to all of them before any is waited for, and the KD term
is their combination, ``teacher_combine="sum"`` (the weighted mean of each teacher's divergence)
or ``"mixture"`` (the divergence to their weighted mixture), as student_trainer/teachers.py
computes it for ``student-trainer train``; each teacher's own divergence is logged as
``kd_loss/NAME``. Every teacher scores every example (no routing here).

One teacher session per process. Each process (rank) joins the teacher the first time it
needs it, as rank ``args.process_index`` of job ``args.run_name`` (else the output folder's
name), on ``args.device``. Under DDP or FSDP every rank asks for the outputs of exactly the
micro-batches it trains on, so nothing is exchanged between ranks for the teacher's sake.

Gradient accumulation. When the Trainer counts the target tokens of an optimizer step
(``num_items_in_batch``: models that accept loss kwargs, as HF causal LMs do), the model's CE
is a sum over this micro-batch divided by that count, and the Trainer does not divide by the
accumulation steps. KD is then weighted the same way (its micro-batch mean times this
micro-batch's share of the tokens), so both terms are means over every target token of the
step, across ranks too. Otherwise both are micro-batch means and the Trainer divides by the
accumulation steps, as it does for any loss.

Prefetch. The Trainer draws an optimizer step's micro-batches before training them
(``get_batch_samples``); the teacher's outputs for micro-batch i + 1 are requested when
micro-batch i starts, so the teacher works while the student trains. At most two micro-batches
of teacher outputs are held at once. Every micro-batch, including the first of a step, is
submitted before the student's forward and awaited after it (student_trainer/hf_teacher.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Trainer

from distill_common.attention_inputs import AttentionCapture
from distill_common.outputs import AttentionInputs, FinalHidden, Logits, TeacherOutput, TopK
from student_trainer import losses
from student_trainer.hf_teacher import FEED_CLIENT_ARGUMENTS, TeacherFeed
from student_trainer.teachers import EnsembleOutput, TeacherSpec, ensemble_kd, plan_teachers


class DistillationTrainer(Trainer):
    """A `transformers.Trainer` whose loss mixes KD from a remote teacher with the model's CE.

    teacher_address: host:port of a running teacher server.
    teacher_outputs: a store of the teacher's outputs (`student-trainer dump`, docs/training.md),
        read instead of a live teacher; rows are found by their ids and mask, so the batches must be
        fixed-length rows the store holds. With teacher_address too, a batch with rows the store
        lacks is asked of the teacher and written into it.
    kd_weight: alpha in alpha * KD + (1 - alpha) * CE; 0 trains as the plain Trainer and never
        contacts the teacher.
    kd_loss, temperature, jsd_beta, kd_chunk_tokens: see `student_trainer.losses.kd_loss`.
    topk: 0 distils the full logits; k > 0 asks the teacher for its k most likely tokens and their
        log-probabilities (at `temperature`) only.
    topk_tail: with topk, what the loss does with the teacher's mass outside the k tokens (see
        `student_trainer.losses.topk_kd_loss`): "bucket" or "none".
    teacher_timeout_s: the longest wait for the teacher, to join and for one batch's outputs.
    teacher_auth_token: the teacher's --auth-token; None reads TEACHER_AUTH_TOKEN.
    teacher_client_options: more keyword arguments of `TeacherClient`, e.g. tls_ca, tls_cert,
        tls_key (a teacher with TLS), reconnect_timeout_s, weight (this job's share).
    head_on_student: receive the teacher's final hidden state and its output head instead of
        its logits (see `student_trainer.losses.kd_loss_from_hidden`; with topk, compared on
        the top k of the logits the head gives).
    attention_layers, attention_weight: teacher decoder layers (0-based) whose attention inputs
        the student's layer at the same relative depth matches, and the weight of that term.
    attention_relation_heads, attention_block_rows: see `student_trainer.losses.relation_kl`.
    teachers: several teachers instead of teacher_address / teacher_outputs: a list of dicts (or
        `student_trainer.teachers.TeacherSpec`s) with the keys of `--teacher-spec` (name, address or
        store, weight, temperature, kind, topk, tail, loss, ...); keys left out take this trainer's
        arguments (kd_loss, temperature, topk, topk_tail, head_on_student).
    teacher_combine: with `teachers`, "sum" or "mixture" (module docstring).
    """

    def __init__(self, *args, teacher_address: str | None = None, teacher_outputs: str | None = None,
                 kd_weight: float = 0.5, kd_loss: str = "forward_kl",
                 temperature: float = 1.0, jsd_beta: float = 0.5, topk: int = 0, topk_tail: str = "bucket",
                 teacher_timeout_s: float = 600.0,
                 kd_chunk_tokens: int = 1024, teacher_auth_token: str | None = None,
                 teacher_client_options: dict | None = None, head_on_student: bool = False,
                 attention_layers: tuple[int, ...] = (), attention_weight: float = 0.0,
                 attention_relation_heads: int = 8, attention_block_rows: int = 256, teachers: list | None = None,
                 teacher_combine: str = "sum", **kwargs):
        if teacher_address is not None and (not isinstance(teacher_address, str) or not teacher_address):
            raise ValueError(f"teacher_address must be 'host:port' of a running teacher, got {teacher_address!r}")
        if teachers and (teacher_address or teacher_outputs):
            raise ValueError("teachers= names every teacher (address or store each): leave out teacher_address and "
                             "teacher_outputs")
        if not teacher_address and not teacher_outputs and not teachers:
            raise ValueError("give teacher_address='host:port' of a running teacher, or teacher_outputs=DIR, a store "
                             "of its outputs (student-trainer dump), or both (the store, filled by the teacher)")
        if not 0.0 <= kd_weight <= 1.0:
            raise ValueError(f"kd_weight must lie in [0, 1] (the loss is kd_weight * KD + (1 - kd_weight) * CE), "
                             f"got {kd_weight!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"topk must be an int >= 0 (0 distils the full logits), got {topk!r}")
        if not teacher_timeout_s > 0:
            raise ValueError(f"teacher_timeout_s must be > 0, got {teacher_timeout_s!r}")
        losses.check_options(kd_loss, temperature, jsd_beta, kd_chunk_tokens)  # the losses' own checks, once
        losses.check_topk_tail(topk_tail)
        losses.check_relation_options(attention_relation_heads, attention_block_rows)
        attention_layers = tuple(attention_layers)
        if not attention_weight >= 0 or bool(attention_layers) != (attention_weight > 0):
            raise ValueError(f"attention_layers {list(attention_layers)} and attention_weight {attention_weight!r} go "
                             "together: give both (layers to match and a weight > 0) or neither")
        if head_on_student and kd_weight == 0:
            raise ValueError("head_on_student applies the teacher's output head for the KD term: it needs kd_weight > 0")
        plans = ()
        if teachers:
            if kd_weight == 0 or attention_layers:
                raise ValueError("several teachers distil logits: give kd_weight > 0, and leave out attention_layers "
                                 "(which match one teacher's layers)")
            if teacher_combine not in ("sum", "mixture"):
                raise ValueError(f"teacher_combine must be 'sum' or 'mixture', got {teacher_combine!r}")
            specs = [spec if isinstance(spec, TeacherSpec) else TeacherSpec.from_dict(spec, f"teachers[{i}]")
                     for i, spec in enumerate(teachers)]
            plans = plan_teachers(_EnsembleSettings(kd_loss, temperature, jsd_beta, kd_chunk_tokens, topk, topk_tail,
                                                    head_on_student, teacher_combine), specs)
        options = dict(teacher_client_options or {})
        taken = FEED_CLIENT_ARGUMENTS & options.keys()
        if taken:
            raise ValueError(f"teacher_client_options may not set {sorted(taken)}: the trainer sets them (use "
                             "its own arguments, e.g. topk=, teacher_timeout_s=, teacher_auth_token=)")
        super().__init__(*args, **kwargs)
        self.teacher_address = teacher_address
        self.teacher_outputs = teacher_outputs
        self.kd_weight = float(kd_weight)
        self.kd_loss_kind = kd_loss
        self.temperature = float(temperature)
        self.jsd_beta = float(jsd_beta)
        self.topk = topk
        self.topk_tail = topk_tail
        self.teacher_timeout_s = float(teacher_timeout_s)
        self.kd_chunk_tokens = kd_chunk_tokens
        self.teacher_auth_token = teacher_auth_token
        self.teacher_client_options = options
        self.head_on_student = bool(head_on_student)
        self.attention_layers = attention_layers
        self.attention_weight = float(attention_weight)
        self.attention_relation_heads = attention_relation_heads
        self.attention_block_rows = attention_block_rows
        self._capture: AttentionCapture | None = None  # the student's attention inputs, once the teacher joined
        self._attention_map: dict[int, int] = {}  # teacher decoder layer -> the student's
        self._feed: TeacherFeed | None = None  # the teacher's outputs, when distilling from one
        self.teacher_plans, self.teacher_combine = plans, teacher_combine
        self._feeds: dict[str, TeacherFeed] = {}  # several teachers: each one's outputs, by name
        self._since_log: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (sum, count) of micro-batch means
        if not self.distils:
            return
        if self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError("DistillationTrainer computes the loss itself: it cannot be combined with "
                             "label_smoothing_factor or compute_loss_func. Drop them, or set kd_weight=0")
        checkpointing = self.args.gradient_checkpointing_kwargs or {}
        if attention_layers and self.args.gradient_checkpointing and checkpointing.get("use_reentrant", False):
            # Reentrant checkpointing runs the first forward without autograd: the queries, keys
            # and values captured there carry no gradient, and the attention term would teach nothing.
            raise ValueError("attention_layers needs non-reentrant gradient checkpointing: set "
                             "gradient_checkpointing_kwargs={'use_reentrant': False} in the TrainingArguments")
        # Read now, before the Trainer wraps the model: a sharded FSDP weight no longer has its shape.
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is None:
            raise ValueError(f"DistillationTrainer distils next-token logits: {type(self.model).__name__} has no "
                             "output embedding (get_output_embeddings() is None); use a causal LM")
        # A processor (multimodal) carries its tokenizer; the teacher compares fingerprints.
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        feed_options = dict(
            device=self.args.device,
            job_id=self.args.run_name or os.path.basename(os.path.normpath(self.args.output_dir)),
            job_rank=self.args.process_index, tokenizer=tokenizer if hasattr(tokenizer, "get_vocab") else None,
            vocab_size=head.weight.shape[0], timeout_s=self.teacher_timeout_s, auth_token=teacher_auth_token)
        if plans:
            self._feeds = {plan.name: TeacherFeed(plan.address or None, plan.store or None, plan.outputs(),
                                                  client_options={"weight": plan.share, **options},
                                                  summary=plan.describe(), **feed_options) for plan in plans}
            return
        self._feed = TeacherFeed(teacher_address, teacher_outputs, self._teacher_outputs(), client_options=options,
                                 summary=self._summary(), **feed_options)

    # ---- the loss ------------------------------------------------------------------------

    @property
    def distils(self) -> bool:
        """Whether the teacher is used at all (else this is the plain Trainer)."""
        return self.kd_weight > 0 or self.attention_weight > 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.distils:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("DistillationTrainer needs `labels` in every batch: -100 marks positions that are not "
                             "targets, and KD counts the same positions as CE. For plain text, "
                             "DataCollatorForLanguageModeling(tokenizer, mlm=False) adds them")
        packed = sorted({"position_ids", "shift_labels"} & set(inputs))
        if packed:
            raise ValueError(f"the batch carries {packed}: packed (padding-free) batches are not supported, since the "
                             "teacher sees only input_ids and attention_mask. Use a padding collator")
        if self._feeds:  # every teacher's batch in flight before any is waited for
            futures = {name: feed.future(inputs, from_prefetch=model.training) for name, feed in self._feeds.items()}
        else:
            future = self._feed.future(inputs, from_prefetch=model.training)

        # The same rule as Trainer.training_step's: with a token count for the whole step the
        # model's CE is already a share of the step's mean, and the Trainer will not divide by
        # the accumulation steps; KD must then be weighted the same way (module docstring).
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        model_inputs = dict(inputs)
        if self.kd_weight == 1:
            del model_inputs["labels"]  # no CE to compute: spares the model's float32 copy of the logits
        elif scaled:
            model_inputs["num_items_in_batch"] = num_items_in_batch
        capture = self._student_capture()
        with capture if capture is not None else contextlib.nullcontext():
            outputs = model(**model_inputs)
        logits = outputs.logits
        mask = labels[:, 1:] != -100
        n_tokens = mask.sum()
        token_share = n_tokens / num_items_in_batch if scaled else 1.0

        loss = logits.new_zeros((), dtype=torch.float32)
        if self._feeds:
            kd = self._ensemble_kd(logits[:, :-1], {name: self._feeds[name].wait(f) for name, f in futures.items()},
                                   mask, record=model.training)
            loss = loss + self.kd_weight * kd * token_share
            if model.training:
                self._record("kd_loss", kd)
        teacher_out = self._feed.wait(future) if self._feed is not None else None
        if self.kd_weight > 0 and teacher_out is not None:
            kd = self._kd(logits[:, :-1], teacher_out, mask)  # mean over this micro-batch's targets
            loss = loss + self.kd_weight * kd * token_share
            if model.training:
                self._record("kd_loss", kd)
        if self.attention_weight > 0:
            attention = self._attention(capture.take(), teacher_out, inputs.get("attention_mask"), logits.device)
            loss = loss + self.attention_weight * attention * token_share
            if model.training:
                self._record("attention_loss", attention)
        if self.kd_weight < 1:
            ce = outputs.loss
            if ce is None:  # a model that takes labels but returns no loss
                ce = F.cross_entropy(logits[:, :-1][mask].float(), labels[:, 1:][mask], reduction="sum")
                ce = ce / (num_items_in_batch if scaled else n_tokens.clamp(min=1))
            loss = loss + (1 - self.kd_weight) * ce
            if model.training:
                self._record("ce_loss", ce * (num_items_in_batch / n_tokens.clamp(min=1)) if scaled else ce)
        if scaled and self.args.average_tokens_across_devices:
            # As Trainer.compute_loss: the count covers every rank's tokens, while DDP and FSDP
            # average the ranks' gradients.
            loss = loss * (self.args.n_gpu if self.args.n_gpu > 1
                           else self.accelerator.num_processes // self.get_tp_size())
        return (loss, outputs) if return_outputs else loss

    def _kd(self, student: torch.Tensor, out: TeacherOutput, mask: torch.Tensor) -> torch.Tensor:
        options = dict(kind=self.kd_loss_kind, temperature=self.temperature, jsd_beta=self.jsd_beta,
                       chunk_tokens=self.kd_chunk_tokens)
        device = student.device  # the client's device, unless the model is split over several
        if self.head_on_student:
            head = self._feed.teacher.joined.head
            return losses.kd_loss_from_hidden(student, out.final_hidden[:, :-1].to(device), head, mask,
                                              topk=self.topk, tail=self.topk_tail, **options)
        if self.topk:
            return losses.topk_kd_loss(student, out.topk_values[:, :-1].to(device),
                                       out.topk_indices[:, :-1].to(device), mask, tail=self.topk_tail, **options)
        return losses.kd_loss(student, out.logits[:, :-1].to(device), mask, **options)

    def _ensemble_kd(self, student: torch.Tensor, outs: dict, mask: torch.Tensor, record: bool) -> torch.Tensor:
        """The teachers' combined KD term (student_trainer/teachers.py: `ensemble_kd`)."""
        device = student.device
        outs = {name: _on(out, device) for name, out in outs.items()}
        heads = {name: feed.teacher.joined.head for name, feed in self._feeds.items()
                 if feed.teacher is not None and feed.teacher.joined.head is not None}
        matched = {name: feed.teacher.matched_student_ids.to(device) for name, feed in self._feeds.items()
                   if feed.teacher is not None and feed.teacher.matched_student_ids is not None}
        settings = _EnsembleSettings(self.kd_loss_kind, self.temperature, self.jsd_beta, self.kd_chunk_tokens,
                                     self.topk, self.topk_tail, self.head_on_student, self.teacher_combine,
                                     teacher_plans=self.teacher_plans)
        ens = EnsembleOutput(0, outs, {name: None for name in outs})
        kd, own = ensemble_kd(settings, student, ens, mask.to(device), heads, matched, per_teacher=record)
        for name, value in own.items():
            self._record(f"kd_loss/{name}", torch.tensor(value))
        return kd

    def _attention(self, student: dict, out: TeacherOutput, attention_mask, device) -> torch.Tensor:
        """Mean over the layers asked of the MiniLMv2 relation loss, over the real tokens."""
        mask = attention_mask.to(device) if attention_mask is not None else None
        per_layer = [losses.attention_relation_loss(student[self._attention_map[t]],
                                                    tuple(x.to(device) for x in out.attention_inputs[t]), mask,
                                                    relation_heads=self.attention_relation_heads,
                                                    block_rows=self.attention_block_rows)
                     for t in self.attention_layers]
        return torch.stack(per_layer).mean()

    def _student_capture(self) -> AttentionCapture | None:
        """The capture of the student's attention inputs at the layers matched to the teacher's
        (their depth needs the teacher's layer count: known once it joined)."""
        if not self.attention_layers:
            return None
        if self._capture is None:
            from student_trainer.train import attention_layer_for

            teacher_layers = self._feed.client().info.num_layers
            student_layers = self.model.config.num_hidden_layers
            self._attention_map = {t: attention_layer_for(t, teacher_layers, student_layers)
                                   for t in self.attention_layers}
            self._capture = AttentionCapture(self.model, set(self._attention_map.values()))
        return self._capture

    # ---- the teacher ---------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.distils:
            for feed in self._feeds.values() or (self._feed,):
                feed.step(batch_samples)  # the Trainer trains these next, in this order
        return batch_samples, num_items_in_batch

    def _teacher_outputs(self) -> tuple:
        kinds = []
        if self.kd_weight > 0:
            kinds.append(FinalHidden() if self.head_on_student else TopK(self.topk, self.temperature) if self.topk
                         else Logits())
        if self.attention_layers:
            kinds.append(AttentionInputs(self.attention_layers))
        return tuple(kinds)

    def _summary(self) -> str:
        """What this rank distils, for the log line at join."""
        return (f"kd_weight {self.kd_weight:g}, {self.kd_loss_kind}, temperature {self.temperature:g}"
                + (f", top-{self.topk} (tail: {self.topk_tail})" if self.topk else "")
                + (", the teacher's head on the student" if self.head_on_student else "")
                + (f", attention layers {list(self.attention_layers)} weight {self.attention_weight:g}"
                   if self.attention_layers else ""))

    def close_teacher(self) -> None:
        """Leaves the teacher session, if one is open (the next loss computation joins again)."""
        for feed in (*self._feeds.values(), self._feed):
            if feed is not None:
                feed.close()

    # ---- lifetime and logs ---------------------------------------------------------------

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_teacher()

    def __del__(self):
        # A trainer dropped without train() returning (evaluate() only, an interrupted notebook)
        # still leaves its session rather than waiting for the teacher's lease to expire.
        for feed in (*self.__dict__.get("_feeds", {}).values(), self.__dict__.get("_feed")):
            if feed is not None and feed.teacher is not None:
                feed.teacher.close(timeout_s=0)

    def _record(self, name: str, micro_batch_mean: torch.Tensor) -> None:
        total, count = self._since_log.get(name, (0.0, 0))
        self._since_log[name] = (total + micro_batch_mean.detach().float(), count + 1)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        # Next to the Trainer's "loss": this rank's mean of the micro-batch means since the last log.
        if "loss" in logs:
            for name, (total, count) in self._since_log.items():
                logs[name] = (total / count).item()
            self._since_log.clear()
        super().log(logs, *args, **kwargs)


@dataclass
class _EnsembleSettings:
    """The run settings several teachers are resolved against and combined with (student_trainer/
    teachers.py reads a TrainConfig's fields of these names): this trainer's arguments."""

    loss: str
    temperature: float
    jsd_beta: float
    kd_chunk_tokens: int
    topk: int
    topk_tail: str
    head_on_student: bool
    teacher_combine: str
    teacher_plans: tuple = ()
    teacher_route: str = "all"
    teacher_weight: float = 1.0
    cross_topk: int = 8
    cross_match: str = "exact"
    on_policy: bool = False


def _on(out: TeacherOutput, device: torch.device) -> TeacherOutput:
    """The tensors the KD terms read, on the student's device (a model split over several keeps its
    logits on the last)."""
    moved = {name: getattr(out, name).to(device) for name in ("logits", "topk_values", "topk_indices", "final_hidden",
                                                              "projected_probs", "unmatched_mass", "unmatched_topk",
                                                              "sorted_probs")
             if getattr(out, name) is not None}
    return dataclasses.replace(out, **moved)
