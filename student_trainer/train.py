"""The distillation trainer, top to bottom: its setup and its step, run by the loop it shares
with EAGLE-3 (student_trainer/loop.py).

One process per student rank (torchrun for several: DDP across ranks, each rank its
own teacher session). The teacher's outputs for the next `--prefetch` micro-batches
are requested while the current one trains, so a step costs max(teacher, student),
not their sum. They come from a teacher server, or from a store of them computed once
(`--teacher-outputs`, student_trainer/store/), read the same way. With
`--on-policy-fraction` the batches are prompts the student completes and their losses
those of student_trainer/onpolicy.py; the loop is the same. With several teachers
(`--teacher-spec`, `--teachers`) each micro-batch goes to all of them at once and their losses
combine as student_trainer/teachers.py says; the loop is the same again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distill_common.attention_inputs import AttentionCapture
from distill_common.outputs import (AttentionInputs, FinalHidden, HiddenStates, Logits, Output, OutputHead,
                                    ProjectedNext, SortedProbs, TeacherOutput, TopK)
from distill_common.settings import ConfigError, non_defaults
from student_trainer import onpolicy
from student_trainer.checkpoint import latest_checkpoint, load_rank_state, save_checkpoint
from student_trainer.client import TeacherClient
from student_trainer.config import TrainConfig
from student_trainer.data import BatchIterator, PackedDataset, PromptDataset
from student_trainer.errors import TeacherUnavailable
from student_trainer.loop import resume, run_loop
from student_trainer.losses import HiddenProjection, attention_relation_loss, hidden_state_loss
from student_trainer.rank import set_up_rank
from student_trainer.teachers import EnsembleOutput, TeacherSet, ensemble_kd, open_teachers, step_metrics, teacher_kd

log = logging.getLogger(__name__)


# ---- pieces the loop is made of --------------------------------------------------------


class TeacherPrefetcher:
    """Keeps `depth` micro-batches submitted to the teacher ahead of the one training.

    Remembers the data position before each batch it drew, so a checkpoint records the
    first batch not yet trained on: the in-flight ones are simply asked for again
    after a resume. Batches that cannot be drawn again alike (the student's samples) are
    checkpointed themselves instead (`drawn_ahead`) and given back as `replay`.
    """

    def __init__(self, teacher: TeacherClient | None, batches, depth: int, timeout_s: float, replay=()):
        """`timeout_s`: the longest wait for one batch's outputs (then TeacherUnavailable)."""
        self.teacher, self.batches, self.depth, self.timeout_s = teacher, batches, depth, timeout_s
        self._queue: deque = deque()
        self._replay = deque(replay)  # submitted before any new batch is drawn

    def _fill(self, size: int) -> None:
        while len(self._queue) < size:
            position = self.batches.state_dict()
            batch = self._replay.popleft() if self._replay else next(self.batches)
            # Several teachers (a TeacherSet) are sent the batch's route too, under field routing.
            route = {"route": batch["route"]} if "route" in batch else {}
            future = (self.teacher.submit(batch["input_ids"], batch["attention_mask"], score_ids=batch.get("score_ids"),
                                          **route)
                      if self.teacher else None)
            self._queue.append((position, batch, future))

    def next(self) -> tuple[dict, TeacherOutput | EnsembleOutput | None, float]:
        """The next micro-batch, its teacher outputs, and the seconds spent waiting for them
        (several teachers: for the slowest; each one's wait in the EnsembleOutput's `waits`)."""
        self._fill(self.depth + 1)
        _, batch, future = self._queue.popleft()
        start = time.perf_counter()
        out = teacher_result(self.teacher, future, self.timeout_s) if future is not None else None
        waited_s = time.perf_counter() - start
        if isinstance(out, EnsembleOutput):
            out.waits = {name: max(0.0, at - start) for name, at in out.resolved_at.items()}
        return batch, out, waited_s

    def data_state(self) -> dict:
        return self._queue[0][0] if self._queue else self.batches.state_dict()

    def drawn_ahead(self) -> list[dict]:
        """The batches drawn and not yet trained on, oldest first."""
        return [batch for _, batch, _ in self._queue] + list(self._replay)

    def drop_ahead(self) -> None:
        """Waits for the batches submitted ahead (each at most `timeout_s`) and drops them, failed ones
        included: a bench that ends a run frees their slots and memory before the next."""
        while self._queue:
            _, _, future = self._queue.popleft()
            if future is not None:
                try:
                    future.result(timeout=self.timeout_s)
                except Exception:  # noqa: BLE001 - dropped either way; the run that needed it has reported
                    pass


def load_dataset(cfg: TrainConfig, tokenizer, path: str, skip_bad_lines: bool = False):
    """Packed examples (with each token's teacher, under --teacher-route field:NAME), or
    (on-policy) prompts with their reference completions."""
    if cfg.on_policy:
        return PromptDataset(path, tokenizer, cfg.seq_len, min_new_tokens=cfg.max_new_tokens,
                             skip_bad_lines=skip_bad_lines)
    route = cfg.teacher_route.removeprefix("field:") if cfg.teacher_route != "all" else ""
    return PackedDataset(path, tokenizer, cfg.seq_len, mode=cfg.pack_mode, skip_bad_lines=skip_bad_lines,
                         route_field=route, route_names=[plan.name for plan in cfg.teacher_plans] if route else ())


def open_teacher(cfg, device: torch.device, outputs: tuple[Output, ...], *, tokenizer, vocab_size: int, dataset,
                 job_id: str, rank: int, dtype: str | None = None, address: str | None = None,
                 store: str | None = None, weight: float | None = None):
    """Where a run's teacher outputs come from (the trainer's, EAGLE-3's `cfg`): the teacher server
    (`--teacher`), a store of them (`--teacher-outputs`, student_trainer/store/), or both: the
    store, and the teacher for what it lacks, written through. Either way a source with
    TeacherClient's interface, asked for `outputs` in `dtype` (None: the teacher's, or the store's).
    `address`, `store`, `weight`: one of several teachers' (default: --teacher, --teacher-outputs,
    --teacher-weight)."""
    address = cfg.teacher if address is None else address
    store = cfg.teacher_outputs if store is None else store
    live = None
    if address:
        live = TeacherClient(
            address, device, outputs=outputs, dtype=dtype, tokenizer=tokenizer, vocab_size=vocab_size,
            max_inflight=cfg.prefetch + 1, job_id=job_id, job_rank=rank, transfer_timeout_s=cfg.teacher_timeout_s,
            reconnect_timeout_s=cfg.teacher_reconnect_timeout_s, max_resubmits=cfg.teacher_max_resubmits,
            weight=cfg.teacher_weight if weight is None else weight, refuse_quantized=cfg.refuse_fp8_teacher,
            max_teacher_kl=cfg.max_teacher_kl, tls_ca=cfg.teacher_tls, tls_cert=cfg.teacher_tls_cert or None,
            tls_key=cfg.teacher_tls_key or None)
    if not store:
        return live
    from student_trainer.store import open_store_teacher

    try:
        return open_store_teacher(store, device, outputs, dtype=dtype, dataset=dataset,
                                  data_path=cfg.data, tokenizer=tokenizer, vocab_size=vocab_size, teacher=live,
                                  model_name=live.info.model_name if live is not None else "",
                                  timeout_s=cfg.teacher_timeout_s + cfg.teacher_reconnect_timeout_s)
    except BaseException:
        if live is not None:
            live.close(timeout_s=5)
        raise


def teacher_result(teacher: TeacherClient, future: Future, timeout_s: float) -> TeacherOutput:
    """A batch's outputs; the teacher's error (a TeacherError that says why) when it failed, and
    TeacherUnavailable when none came within `timeout_s`.

    The client resolves or fails every batch within its own timeouts (a transfer, a reconnect,
    a bounded number of resubmits): this wait is only the backstop.
    """
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise TeacherUnavailable(
            f"the teacher at {teacher.address} sent no outputs for a batch within {timeout_s:.0f}s "
            "(--teacher-timeout-s plus --teacher-reconnect-timeout-s): it is overloaded or stuck (see its log and "
            "/v1/status), or raise --teacher-timeout-s", grpc.StatusCode.DEADLINE_EXCEEDED) from None


def student_layer_for(teacher_layer: int, teacher_layers: int, student_layers: int) -> int:
    """Teacher hidden-state index -> the student's at the same relative depth (0 stays 0).

    Halves round up (not to even), so a layer never maps back onto the embeddings."""
    return math.floor(teacher_layer * student_layers / teacher_layers + 0.5)


def attention_layer_for(teacher_layer: int, teacher_layers: int, student_layers: int) -> int:
    """Teacher decoder layer (0-based) -> the student's at the same relative depth: layer i is
    hidden state i + 1's, mapped as `student_layer_for` maps hidden states (the last to the last)."""
    return max(0, student_layer_for(teacher_layer + 1, teacher_layers, student_layers) - 1)


def teacher_outputs(cfg: TrainConfig, plan=None) -> tuple[Output, ...]:
    """What `distill_losses` reads of the teacher: its full logits or top k, or its final hidden
    state for its head on the student, for KD; the hidden states and attention inputs of the
    layers asked (on-policy: what onpolicy.distill_losses reads). `plan`: one of several teachers
    (student_trainer/teachers.py), asked what its own settings say."""
    if cfg.on_policy:
        return onpolicy.teacher_outputs(cfg, None if plan is None else plan.temperature)
    if plan is not None:
        return plan.outputs()
    if cfg.cross_tokenizer:
        if cfg.loss == "gold":
            return (ProjectedNext(cfg.cross_topk, by_prefix=cfg.cross_match == "prefix"),)
        return (SortedProbs(cfg.cross_topk),)
    kinds = []
    if cfg.uses_logits:
        kinds.append(FinalHidden() if cfg.head_on_student else TopK(cfg.topk, cfg.temperature) if cfg.topk
                     else Logits())
    if cfg.hidden_layers:
        kinds.append(HiddenStates(cfg.hidden_layers))
    if cfg.attention_layers:
        kinds.append(AttentionInputs(cfg.attention_layers))
    return tuple(kinds)


class StudentMaps:
    """Which student layer meets which teacher layer, and what the loss terms learn besides the student."""

    def __init__(self, projections: torch.nn.ModuleDict | None = None, hidden: dict[int, int] | None = None,
                 attention: dict[int, int] | None = None, head: OutputHead | None = None):
        self.projections = projections  # teacher hidden layer (as str) -> HiddenProjection
        self.hidden = hidden or {}  # teacher hidden-state index -> the student's
        self.attention = attention or {}  # teacher decoder layer -> the student's
        self.head = head  # the teacher's output head, for --head-on-student
        self.matched_ids: torch.Tensor | None = None  # --loss gold: the student ids of the projection's columns
        # Several teachers: each one's head (kind=head) and matched ids (kind=gold), by name.
        self.heads: dict[str, OutputHead] = {}
        self.matched: dict[str, torch.Tensor] = {}


def several_teachers_maps(teachers: TeacherSet, device: torch.device) -> StudentMaps:
    """What several teachers' losses need besides the student: each one's head and matched ids."""
    maps = StudentMaps()
    for plan, source in zip(teachers.plans, teachers.sources):
        if plan.head_on_student:
            maps.heads[plan.name] = source.joined.head
        if source.matched_student_ids is not None:
            maps.matched[plan.name] = source.matched_student_ids.to(device)
    return maps


def build_maps(cfg: TrainConfig, model, teacher_layers: int, teacher_hidden: int, head: OutputHead | None,
               device: torch.device) -> tuple[StudentMaps, AttentionCapture | None]:
    """What the loss terms need besides the student: the hidden-state projections and layer map,
    the attention layer map and the capture of the student's attention inputs, the teacher's head."""
    maps, capture = StudentMaps(), None
    student_layers = model.config.num_hidden_layers
    if cfg.hidden_layers:
        maps.projections = torch.nn.ModuleDict({
            str(t): HiddenProjection(model.config.hidden_size, teacher_hidden, device=device) for t in cfg.hidden_layers})
        maps.hidden = {t: student_layer_for(t, teacher_layers, student_layers) for t in cfg.hidden_layers}
    if cfg.attention_layers:
        maps.attention = {t: attention_layer_for(t, teacher_layers, student_layers) for t in cfg.attention_layers}
        capture = AttentionCapture(model, set(maps.attention.values()))
    if cfg.head_on_student:
        maps.head = head
    return maps, capture


def distill_losses(cfg: TrainConfig, logits: torch.Tensor, student_hidden, batch: dict, out: TeacherOutput | None,
                   maps: StudentMaps, student_attention: dict | None = None) -> dict[str, torch.Tensor]:
    """kd_weight * KD + ce_weight * CE (+ hidden_weight * hidden + attention_weight * attention).

    Position t predicts token t + 1; a target counts where loss_mask and attention_mask
    are 1 (completion / assistant tokens only, for those data shapes). The hidden-state and
    attention terms count every real token.
    """
    device = logits.device
    targets = batch["input_ids"][:, 1:].to(device)
    mask = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).to(device).bool()
    student = logits[:, :-1]
    losses = {}
    total = logits.new_zeros((), dtype=torch.float32)
    if cfg.ce_factor > 0:
        losses["ce"] = (F.cross_entropy(student[mask].float(), targets[mask]) if mask.any()
                        else student.sum() * 0.0)
        total = total + cfg.ce_factor * losses["ce"]
    if cfg.several_teachers:
        losses["kd"], own = ensemble_kd(cfg, student, out, mask, maps.heads, maps.matched)
        losses.update({f"kd/{name}": torch.tensor(value) for name, value in own.items()})
        total = total + cfg.kd_weight * losses["kd"]
    elif cfg.uses_logits:
        losses["kd"] = logit_kd(cfg, student, out, mask, maps.head, maps.matched_ids)
        total = total + cfg.kd_weight * losses["kd"]
    real = batch["attention_mask"].to(device).bool()
    if cfg.hidden_layers:
        per_layer = [hidden_state_loss(student_hidden[maps.hidden[t]], out.hidden_states[t], real,
                                       kind=cfg.hidden_loss, projection=maps.projections[str(t)])
                     for t in cfg.hidden_layers]
        losses["hidden"] = torch.stack(per_layer).mean()
        total = total + cfg.hidden_weight * losses["hidden"]
    if cfg.attention_layers:
        per_layer = [attention_relation_loss(student_attention[maps.attention[t]], out.attention_inputs[t], real,
                                             relation_heads=cfg.attention_relation_heads,
                                             block_rows=cfg.attention_block_rows)
                     for t in cfg.attention_layers]
        losses["attention"] = torch.stack(per_layer).mean()
        total = total + cfg.attention_weight * losses["attention"]
    losses["loss"] = total
    return losses


def logit_kd(cfg: TrainConfig, student: torch.Tensor, out: TeacherOutput, mask: torch.Tensor,
             head: OutputHead | None = None, matched_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The KD loss of the student's logits [B, S - 1, V] against the teacher's for the same
    positions, with the run's loss settings (student_trainer/teachers.py: `teacher_kd`)."""
    return teacher_kd(cfg, student, out, mask, head, matched_ids)


def train_micro_batch(cfg: TrainConfig, model, batch: dict, out: TeacherOutput | None, autocast,
                      device: torch.device, maps: StudentMaps, capture: AttentionCapture | None) -> dict[str, float]:
    """Forward, losses and backward of one micro-batch (gradients scaled for accumulation)."""
    with autocast, (capture if capture is not None else contextlib.nullcontext()):
        student_out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                            output_hidden_states=bool(cfg.hidden_layers))
    if cfg.on_policy:
        losses = onpolicy.distill_losses(cfg, student_out.logits, batch, out)
    else:
        losses = distill_losses(cfg, student_out.logits, student_out.hidden_states, batch, out, maps,
                                capture.take() if capture is not None else None)
    (losses["loss"] / cfg.grad_accum).backward()
    return {key: value.item() for key, value in losses.items()}


def lr_lambda(cfg: TrainConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if cfg.schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0
    return factor


def build_student(cfg: TrainConfig, device: torch.device, checkpoint: Path | None):
    from distill_common.models import load_causal_lm

    if cfg.lora_r:
        try:
            from peft import LoraConfig, PeftModel, get_peft_model
        except ImportError as e:
            raise ConfigError("--lora-r needs peft: pip install 'teacher-service[lora]'") from e
        # The frozen base in bf16 under --bf16 (half the memory of its weights; autocast computes in
        # bf16 anyway); PEFT keeps the adapter's own weights in float32.
        base = load_causal_lm(cfg.model, device=device, dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                              random_seed=cfg.seed)
        if checkpoint is not None:
            return PeftModel.from_pretrained(base, checkpoint / "model", is_trainable=True)
        targets = cfg.lora_target_modules
        return get_peft_model(base, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                               target_modules=targets if targets == "all-linear" else targets.split(","),
                                               task_type="CAUSAL_LM"))
    source = str(checkpoint / "model") if checkpoint is not None else cfg.model
    return load_causal_lm(source, device=device, dtype=torch.float32, random_seed=cfg.seed)


@torch.no_grad()
def evaluate(model, dataset: PackedDataset, cfg: TrainConfig, device: torch.device,
             teacher: TeacherClient | TeacherSet | None, timeout_s: float,
             maps: StudentMaps | None = None) -> dict[str, float]:
    """Held-out scores per target token: cross-entropy ("eval_ce") and, when the run distils
    logits, the KD loss against the teacher's outputs for the same batches ("eval_kd"; several
    teachers: their combined loss, as in training, with `maps`' heads and matched ids)."""
    model.eval()
    ce_sum, kd_sum, count = 0.0, 0.0, 0
    for start in range(0, len(dataset), cfg.batch_size):
        batch = {k: v[start:start + cfg.batch_size] for k, v in
                 (("input_ids", dataset.input_ids), ("attention_mask", dataset.attention_mask),
                  ("loss_mask", dataset.loss_mask))}
        routes = getattr(dataset, "route", None)
        route = {} if routes is None else {"route": routes[start:start + cfg.batch_size]}
        # Submitted first: the teacher computes while the student's forward runs. (A session that
        # asks for hidden states or attention inputs is sent those too; they go unused here.)
        future = teacher.submit(batch["input_ids"], batch["attention_mask"], **route) if cfg.uses_logits else None
        student = model(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device)).logits[:, :-1]
        mask = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).to(device).bool()
        targets = batch["input_ids"][:, 1:].to(device)
        tokens = int(mask.sum())
        ce_sum += F.cross_entropy(student[mask].float(), targets[mask], reduction="sum").item()
        if future is not None and isinstance(teacher, TeacherSet):
            outputs = teacher_result(teacher, future, timeout_s)
            kd, _ = ensemble_kd(cfg, student, outputs, mask, maps.heads, maps.matched, per_teacher=False)
            kd_sum += kd.item() * tokens
        elif future is not None:
            head = teacher.joined.head if cfg.head_on_student else None
            kd_sum += logit_kd(cfg, student, teacher_result(teacher, future, timeout_s), mask, head,
                               teacher.matched_student_ids).item() * tokens
        count += tokens
    model.train()
    scores = {"eval_ce": ce_sum / max(count, 1)}
    if cfg.uses_logits:
        scores["eval_kd"] = kd_sum / max(count, 1)
    return scores


def distill_step(cfg: TrainConfig, trained, params: list[torch.Tensor], optimizer, scheduler,
                 prefetcher: TeacherPrefetcher, device: torch.device, world_size: int, autocast, maps: StudentMaps,
                 capture: AttentionCapture | None) -> dict:
    """One optimizer step over `cfg.grad_accum` micro-batches: their losses (averaged), `grad_norm`,
    `teacher_wait_s` and the `tokens` trained on (student_trainer/loop.py's `train_step`)."""
    teacher_wait_s, tokens, sums = 0.0, 0, {}
    per_teacher = []  # several teachers: each micro-batch's EnsembleOutput and each teacher's own loss
    for micro in range(cfg.grad_accum):
        batch, out, wait_s = prefetcher.next()
        teacher_wait_s += wait_s
        tokens += batch["attention_mask"].sum().item()
        # DDP all-reduces gradients on the last micro-batch only.
        sync = micro == cfg.grad_accum - 1 or world_size == 1
        with (contextlib.nullcontext() if sync else trained.no_sync()):
            losses = train_micro_batch(cfg, trained, batch, out, autocast, device, maps, capture)
        own = {key.removeprefix("kd/"): losses.pop(key) for key in [k for k in losses if k.startswith("kd/")]}
        if isinstance(out, EnsembleOutput):
            per_teacher.append((out, own))
        for key, value in losses.items():
            sums[key] = sums.get(key, 0.0) + value / cfg.grad_accum
        del out
    if per_teacher:
        sums.update(step_metrics([plan.name for plan in cfg.teacher_plans], per_teacher))
    if world_size > 1 and maps.projections is not None:
        # DDP wraps the student only: without this each rank would train its own projections,
        # and a resume would give every rank rank 0's.
        for param in maps.projections.parameters():
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
                 if cfg.max_grad_norm > 0 else 0.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {**sums, "grad_norm": grad_norm, "teacher_wait_s": teacher_wait_s, "tokens": tokens}


def progress_postfix(record: dict) -> dict:
    """What the progress bar shows of a step: loss, tokens/s, the wait for the teacher (several
    teachers: for the slowest, and each one's as wait/NAME)."""
    shown = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                 wait=f"{record['teacher_wait_s']:.2f}s")
    shown.update({key: f"{value:.2f}s" for key, value in record.items() if key.startswith("teacher_wait_s/")})
    return {key.replace("teacher_wait_s/", "wait/"): value for key, value in shown.items()}


# ---- the loop ------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict:
    rank, world_size, device, barrier, output_dir = set_up_rank(cfg.device, cfg.output_dir, cfg.seed)
    if rank == 0:
        log.info("trainer settings (non-default): %s", non_defaults(cfg) or "none")
        if not cfg.needs_teacher:
            log.warning("--kd-weight 0 and no hidden-state loss: this is plain cross-entropy training")

    from transformers import AutoTokenizer

    checkpoint = latest_checkpoint(output_dir) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        log.warning("--resume: no checkpoint in %s, starting from scratch", output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    model = build_student(cfg, device, checkpoint)
    if cfg.grad_checkpointing:
        # Non-reentrant: a reentrant checkpoint runs each layer without a graph, so the attention
        # inputs captured in it would carry no gradient.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()

    dataset = load_dataset(cfg, tokenizer, cfg.data, skip_bad_lines=cfg.skip_bad_lines)
    batches = BatchIterator(dataset, cfg.batch_size, seed=cfg.seed, rank=rank, world_size=world_size)
    eval_set = load_dataset(cfg, tokenizer, cfg.eval_data) if cfg.eval_data else None
    total_steps = cfg.max_steps or cfg.epochs * max(1, batches.steps_per_epoch // cfg.grad_accum)

    teacher = None
    if cfg.needs_teacher:
        student_vocab = model.get_output_embeddings().weight.shape[0]
        options = dict(tokenizer=tokenizer if cfg.uses_logits else None,
                       vocab_size=student_vocab if cfg.uses_logits else 0, dataset=dataset,
                       job_id=cfg.job_id or output_dir.name, rank=rank, dtype=cfg.teacher_dtype or None)
        if cfg.several_teachers:
            teacher = open_teachers(cfg, lambda plan: open_teacher(
                cfg, device, teacher_outputs(cfg, plan), address=plan.address, store=plan.store, weight=plan.share,
                **options))
        else:
            teacher = open_teacher(cfg, device, teacher_outputs(cfg), **options)
    if isinstance(teacher, TeacherSet):
        maps, capture = several_teachers_maps(teacher, device), None
    else:
        maps, capture = (build_maps(cfg, model, teacher.info.num_layers, teacher.info.hidden_size,
                                    teacher.joined.head, device) if teacher is not None else (StudentMaps(), None))
    projections = maps.projections
    if teacher is not None and not isinstance(teacher, TeacherSet) and teacher.matched_student_ids is not None:
        maps.matched_ids = teacher.matched_student_ids.to(device)

    params = [p for p in model.parameters() if p.requires_grad]
    params += list(projections.parameters()) if projections is not None else []
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    source, replay = batches, []  # what the loop draws its batches from
    if cfg.on_policy:
        stop_ids = onpolicy.stop_token_ids(tokenizer, cfg.stop_tokens)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
        source = onpolicy.OnPolicyBatches(batches, model, cfg, stop_ids=stop_ids, pad_id=pad_id, rank=rank)
    step = 0
    if checkpoint is not None:
        state = resume(checkpoint, rank, optimizer, scheduler, batches)
        replay = load_rank_state(checkpoint, rank).get("ahead", [])
        if projections is not None:
            projections.load_state_dict(state["projections"])
        step = state["step"]

    trained = model
    if cfg.compile:
        trained = torch.compile(trained)
    if world_size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(
            trained, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext())
    # A batch may wait out a reconnect as well as its transfer: the client resolves it within
    # both (or fails it), so this is only the backstop.
    outputs_timeout_s = cfg.teacher_timeout_s + cfg.teacher_reconnect_timeout_s
    prefetcher = TeacherPrefetcher(teacher, source, cfg.prefetch, outputs_timeout_s, replay)

    def checkpoint_now(step: int) -> Path:
        state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "data": prefetcher.data_state(),
                 "projections": projections.state_dict() if projections is not None else {}}
        rank_state = None
        if cfg.on_policy:  # samples cannot be drawn again alike: the position after them, and they themselves
            state["data"] = batches.state_dict()
            rank_state = {"ahead": prefetcher.drawn_ahead()}
        return save_checkpoint(output_dir, step, model=model, tokenizer=tokenizer, trainer_state=state,
                               rank=rank, world_size=world_size, barrier=barrier, rank_state=rank_state)

    def evaluate_now(step: int, record: dict) -> None:
        if eval_set is None or not cfg.eval_every or (step % cfg.eval_every != 0 and step != total_steps):
            return
        if cfg.on_policy:
            record.update(onpolicy.evaluate(model, eval_set, cfg, device, stop_ids, pad_id))
        else:
            # Held-out rows are asked of the live teacher, never written into the store.
            live = teacher.live_set() if isinstance(teacher, TeacherSet) else getattr(teacher, "teacher", teacher)
            record.update(evaluate(model, eval_set, cfg, device, live, outputs_timeout_s, maps))
        log.info("step %d held-out: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in record.items()
                                                        if k.startswith("eval_")))

    def export() -> None:
        if cfg.lora_r:
            model.save_pretrained(output_dir / "adapter")  # before merging folds it into the base
        final = model.merge_and_unload() if cfg.lora_r else model
        final.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")

    try:
        return run_loop(
            cfg, step=step, total_steps=total_steps, scheduler=scheduler, output_dir=output_dir, rank=rank,
            world_size=world_size, checkpoint=checkpoint_now, export=export, barrier=barrier, desc="distilling",
            train_step=lambda: distill_step(cfg, trained, params, optimizer, scheduler, prefetcher, device,
                                            world_size, autocast, maps, capture),
            evaluate=evaluate_now, postfix=progress_postfix)
    finally:
        if teacher is not None:
            teacher.close(timeout_s=5)
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
