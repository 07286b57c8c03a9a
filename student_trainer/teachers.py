"""One student, several teachers: who they are, how their batches travel, how their losses combine.

A run names each teacher with `--teacher-spec name=NAME,address=HOST:PORT,...` (repeated) or
`--teachers FILE` (a JSON list of the same keys). Each teacher is its own deployment and its
own session (one `TeacherClient`, or a store of its outputs), with its own fair share, so
everything a single teacher does (rejoin after a restart, resubmit, a store written through)
each of them does alone. A run without them has one teacher, `--teacher`, exactly as before.

What each teacher is (`TeacherSpec`, resolved against the run's flags into a `TeacherPlan`):
its address or store, its loss weight, temperature and output kind: full logits, top-k with
its tail, its head on the student (with or without top-k), or a teacher with another tokenizer
through the cross-tokenizer path (gold, uld). Keys left out take the run's flags (`--topk`,
`--temperature`, `--loss`, ...): the flags are every teacher's defaults.

How their batches travel (`TeacherSet`): one micro-batch is submitted to every teacher that
has tokens in it before any is waited for, so a step waits for the slowest teacher, not the
sum, and the prefetcher keeps `--prefetch` micro-batches ahead on all of them at once. The
batch's future resolves with every teacher's outputs (`EnsembleOutput`); a teacher that is
lost resolves its own part later (its client rejoins and resubmits), the others' parts are
kept meanwhile; a teacher whose part fails fails the batch, naming it.

How their losses combine (`ensemble_kd`), with w_i the weights:

- `--teacher-route all` (every teacher scores every example), `--teacher-combine sum`:
  KD = sum_i w~_i D(p_i, q), w~_i = w_i / sum_j w_j, each D at teacher i's own loss settings
  (its temperature T_i, scaled by T_i², its top-k and tail, or gold/uld across tokenizers).
  By convexity this bounds the divergence to the mixture from above for forward KL.
- `--teacher-route all --teacher-combine mixture`: KD = D(m, q) at `--temperature` with
  m = sum_i w~_i p_i (each p_i at its T_i): the student learns the ensemble's distribution.
  Exact over the full vocabulary when every teacher is known there (full logits, its head on
  the student); with top-k teachers, exact over the ids every teacher sent plus one bucket for
  the rest (student_trainer/losses.py: `mixture_kd_loss` says why that is the finest exact one).
- `--teacher-route field:NAME`: each example names its teacher in its field NAME (domain
  experts); a token is scored by its example's teacher only, and a teacher is sent only the
  rows that hold its tokens. KD = sum_i w_i n_i D_i / n, D_i the mean over teacher i's n_i
  tokens of its divergence, n every token: with weights 1, the plain mean over tokens.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import torch

from distill_common.outputs import FinalHidden, Logits, Output, ProjectedNext, SortedProbs, TeacherOutput, TopK
from distill_common.settings import ConfigError
from student_trainer.errors import TeacherError
from student_trainer.losses import (CROSS_TOKENIZER_LOSS_KINDS, LOSS_KINDS, TOPK_TAILS, MixtureTeacher, check_options,
                                    gold_loss, kd_loss, kd_loss_from_hidden, mixture_kd_loss, topk_kd_loss, uld_loss)

log = logging.getLogger(__name__)

TeacherKind = Literal["logits", "topk", "head", "gold", "uld"]
TEACHER_KINDS = ("logits", "topk", "head", "gold", "uld")
Combine = Literal["sum", "mixture"]
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A spec's keys are split at the commas that start another key, so an address may itself hold
# commas (a pool of replicas: host1:50051,host2:50051).
_KEY_START = re.compile(r",(?=\s*[a-z_]+\s*=)")


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher as the command line (or the JSON file) names it; None/"" take the run's flag."""

    name: str
    address: str = ""  # its gRPC address (a pool: a comma list, dns:NAME:PORT, file:PATH)
    store: str = ""  # a store of its outputs (student-trainer dump); with address too, written through
    weight: float = 1.0  # its loss weight (module docstring)
    temperature: float | None = None  # --temperature
    kind: str = ""  # logits, topk, head, gold, uld (default: what --topk, --head-on-student, --loss say)
    topk: int | None = None  # --topk (kind topk, or head with its top k)
    tail: str | None = None  # --topk-tail
    loss: str = ""  # its divergence under --teacher-combine sum: forward_kl, reverse_kl, jsd (--loss)
    cross_topk: int | None = None  # --cross-topk (kind gold, uld)
    cross_match: str | None = None  # --cross-match (kind gold)
    share: float | None = None  # this job's share of that teacher against other jobs (--teacher-weight)

    @classmethod
    def parse(cls, text: str) -> "TeacherSpec":
        """`name=code,address=host:50051,weight=2,kind=topk,topk=64` (keys of this class)."""
        values = {}
        for part in _KEY_START.split(text.strip()):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"--teacher-spec {text!r}: {part!r} is not KEY=VALUE; write e.g. "
                                  "name=code,address=HOST:PORT,weight=1")
            values[key.strip()] = value.strip()
        return cls.from_dict(values, f"--teacher-spec {text!r}")

    @classmethod
    def from_dict(cls, values: dict, where: str) -> "TeacherSpec":
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: a teacher is an object of keys ({', '.join(f.name for f in fields(cls))})")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; a teacher's keys are "
                              f"{', '.join(known)}")
        parsed = {}
        for key, value in values.items():
            kind = _KEY_TYPES.get(key, str)
            try:
                if isinstance(value, bool) or (kind is int and isinstance(value, float)):
                    raise ValueError
                parsed[key] = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: {key}={value!r} is not {_TYPE_NAMES[kind]}") from None
        if "name" not in parsed:
            raise ConfigError(f"{where}: give the teacher a name (name=NAME): its metrics and routing use it")
        return cls(**parsed)


_KEY_TYPES = {"weight": float, "temperature": float, "share": float, "topk": int, "cross_topk": int}
_TYPE_NAMES = {float: "a number", int: "an integer", str: "a string"}


def read_teacher_specs(specs: list[str], path: str) -> list[TeacherSpec]:
    """The teachers of `--teacher-spec` (each occurrence one) and `--teachers FILE` (a JSON list)."""
    teachers = [TeacherSpec.parse(text) for text in specs]
    if path:
        try:
            listed = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"--teachers {path}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--teachers {path}: not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(listed, list):
            raise ConfigError(f"--teachers {path}: a JSON list of teachers, e.g. "
                              '[{"name": "code", "address": "HOST:PORT"}, ...]')
        teachers += [TeacherSpec.from_dict(item, f"--teachers {path}[{i}]") for i, item in enumerate(listed)]
    return teachers


@dataclass(frozen=True)
class TeacherPlan:
    """One teacher resolved against the run's flags: where it is and what its KD term reads (the
    attributes `teacher_kd` reads of a run's settings, so a plan stands in for them)."""

    name: str
    address: str
    store: str
    weight: float
    share: float
    loss: str  # forward_kl, reverse_kl, jsd, gold, uld
    temperature: float
    jsd_beta: float
    kd_chunk_tokens: int
    head_on_student: bool
    topk: int
    topk_tail: str
    cross_topk: int
    cross_match: str

    @property
    def kind(self) -> str:
        if self.cross_tokenizer:
            return self.loss
        return "head" if self.head_on_student else "topk" if self.topk else "logits"

    @property
    def cross_tokenizer(self) -> bool:
        return self.loss in CROSS_TOKENIZER_LOSS_KINDS

    def outputs(self) -> tuple[Output, ...]:
        """What this teacher is asked for (off-policy)."""
        if self.loss == "gold":
            return (ProjectedNext(self.cross_topk, by_prefix=self.cross_match == "prefix"),)
        if self.loss == "uld":
            return (SortedProbs(self.cross_topk),)
        return (FinalHidden() if self.head_on_student else TopK(self.topk, self.temperature) if self.topk
                else Logits(),)

    def describe(self) -> str:
        where = (f"{self.address} + store {self.store}" if self.store and self.address
                 else self.address or f"store {self.store}")
        what = {"logits": "full logits", "topk": f"top-{self.topk} (tail: {self.topk_tail})",
                "head": "its head on the student" + (f", top-{self.topk}" if self.topk else ""),
                "gold": f"gold across tokenizers ({self.cross_match}, k {self.cross_topk})",
                "uld": f"uld across tokenizers (k {self.cross_topk})"}[self.kind]
        return f"{self.name} ({where}; weight {self.weight:g}, {what}, T {self.temperature:g}, {self.loss})"


def plan_teachers(cfg, specs: list[TeacherSpec]) -> tuple[TeacherPlan, ...]:
    """Each spec resolved against `cfg` (TrainConfig), checked alone and together; ConfigError
    names the teacher and the key to change."""
    if not specs:
        return ()
    names = [spec.name for spec in specs]
    for spec in specs:
        if not _NAME.fullmatch(spec.name):
            raise ConfigError(f"teacher name {spec.name!r}: use letters, digits, '_', '.', '-' (at most 64), "
                              "starting with a letter or digit")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"teacher name(s) {', '.join(duplicates)} given twice: each teacher needs its own name")
    plans = tuple(_plan(cfg, spec) for spec in specs)
    if cfg.teacher_combine == "mixture" and cfg.teacher_route == "all":
        for plan in plans:
            if plan.cross_tokenizer:
                raise ConfigError(f"teacher {plan.name}: --teacher-combine mixture mixes distributions over one "
                                  f"vocabulary, which kind={plan.kind} (another tokenizer) is not: use "
                                  "--teacher-combine sum, or route its examples to it (--teacher-route field:NAME)")
            if plan.topk and plan.topk_tail != "bucket":
                raise ConfigError(f"teacher {plan.name}: --teacher-combine mixture keeps each top-k teacher's tail "
                                  "as a bucket (its mass outside the k ids): leave out tail=none")
        given = [spec.name for spec in specs if spec.loss]
        if given:
            raise ConfigError(f"teacher(s) {', '.join(given)}: loss= is each teacher's divergence under "
                              "--teacher-combine sum; the mixture has one, --loss")
    if cfg.on_policy:
        for spec in specs:
            if spec.kind or spec.topk is not None or spec.tail is not None or spec.store:
                raise ConfigError(f"teacher {spec.name}: on-policy training asks every teacher for what "
                                  "--on-policy-loss and --student-topk say (log-probabilities of sampled tokens, "
                                  "or at the student's top k): leave out kind=, topk=, tail= and store=")
    return plans


def _plan(cfg, spec: TeacherSpec) -> TeacherPlan:
    where = f"teacher {spec.name}"
    if not spec.address and not spec.store:
        raise ConfigError(f"{where}: give address=HOST:PORT (a served teacher) or store=DIR (its outputs, "
                          "student-trainer dump), or both (the store, filled by the teacher)")
    if not (spec.weight > 0 and math.isfinite(spec.weight)):
        raise ConfigError(f"{where}: weight={spec.weight} must be > 0 and finite")
    if spec.share is not None and not spec.share > 0:
        raise ConfigError(f"{where}: share={spec.share} must be > 0 (this job's share of that teacher)")
    topk = cfg.topk if spec.topk is None else spec.topk
    if topk < 0:
        raise ConfigError(f"{where}: topk={topk} must be >= 0")
    kind = spec.kind or (cfg.loss if cfg.loss in CROSS_TOKENIZER_LOSS_KINDS else "head" if cfg.head_on_student
                         else "topk" if topk else "logits")
    if kind not in TEACHER_KINDS:
        raise ConfigError(f"{where}: kind={kind!r}: use one of {', '.join(TEACHER_KINDS)}")
    if kind == "logits" and spec.topk:
        raise ConfigError(f"{where}: kind=logits sends the full logits: leave out topk=, or use kind=topk")
    if kind == "topk" and topk < 1:
        raise ConfigError(f"{where}: kind=topk needs topk=K (>= 1), or --topk K for every teacher")
    tail = cfg.topk_tail if spec.tail is None else spec.tail
    if tail not in TOPK_TAILS:
        raise ConfigError(f"{where}: tail={tail!r}: use one of {', '.join(TOPK_TAILS)}")
    temperature = cfg.temperature if spec.temperature is None else spec.temperature
    cross = kind in CROSS_TOKENIZER_LOSS_KINDS
    if cross:
        loss = kind
        if spec.loss:
            raise ConfigError(f"{where}: kind={kind} is its loss: leave out loss=")
        if temperature != 1.0:
            raise ConfigError(f"{where}: kind={kind} compares probabilities at temperature 1: leave out temperature=")
        if spec.topk is not None or spec.tail is not None:
            raise ConfigError(f"{where}: kind={kind} is shaped to the student's tokens: use cross_topk= instead of "
                              "topk= and tail=")
    else:
        loss = spec.loss or (cfg.loss if cfg.loss in LOSS_KINDS else "forward_kl")
        if loss not in LOSS_KINDS:
            raise ConfigError(f"{where}: loss={loss!r}: use one of {', '.join(LOSS_KINDS)} (or kind=gold / uld for "
                              "a teacher with another tokenizer)")
        try:
            check_options(loss, temperature, cfg.jsd_beta, cfg.kd_chunk_tokens)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        if spec.cross_topk is not None or spec.cross_match is not None:
            raise ConfigError(f"{where}: cross_topk= and cross_match= go with kind=gold or uld")
    cross_topk = cfg.cross_topk if spec.cross_topk is None else spec.cross_topk
    cross_match = cfg.cross_match if spec.cross_match is None else spec.cross_match
    if cross and cross_topk < (1 if kind == "uld" else 0):
        raise ConfigError(f"{where}: cross_topk={cross_topk} must be >= 1 for kind=uld, >= 0 for kind=gold")
    if cross_match not in ("exact", "prefix"):
        raise ConfigError(f"{where}: cross_match={cross_match!r}: use exact or prefix")
    return TeacherPlan(
        name=spec.name, address=spec.address, store=spec.store, weight=spec.weight,
        share=cfg.teacher_weight if spec.share is None else spec.share, loss=loss, temperature=temperature,
        jsd_beta=cfg.jsd_beta, kd_chunk_tokens=cfg.kd_chunk_tokens, head_on_student=kind == "head",
        topk=topk if kind in ("topk", "head") else 0, topk_tail=tail, cross_topk=cross_topk,
        cross_match=cross_match)


def route_field(route: str) -> str:
    """The data field of `--teacher-route field:NAME` ("" for `all`); ConfigError for anything else."""
    if route == "all":
        return ""
    name = route.removeprefix("field:")
    if not route.startswith("field:") or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ConfigError(f"--teacher-route {route!r}: use all (every teacher scores every example) or field:NAME "
                          "(each example names its teacher in its field NAME)")
    return name


# ---- the batches ------------------------------------------------------------------------------------------


@dataclass
class EnsembleOutput:
    """One micro-batch's outputs from every teacher asked for it.

    `outputs[name]`: that teacher's TeacherOutput for the rows `rows[name]` of the batch (None:
    every row), or None where it was asked nothing (no token routed to it). `resolved_at`: when
    each part arrived (time.perf_counter); `waits`: how long the step waited for each part (the
    prefetcher fills it in).
    """

    batch_id: int
    outputs: dict[str, TeacherOutput | None]
    rows: dict[str, torch.Tensor | None]
    route: torch.Tensor | None = None  # [B, S]: the teacher index of each token (field routing)
    resolved_at: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # tokens sent to each teacher


class TeacherSet:
    """Several teachers with one source's interface (`submit`, `close`): every teacher's sources
    (TeacherClient or store) side by side, a micro-batch sent to all of those it concerns at once.
    `sources[i]` serves `plans[i]`."""

    def __init__(self, plans: tuple[TeacherPlan, ...], sources: list, route: str = ""):
        self.plans, self.sources, self.route = plans, sources, route
        self.names = [plan.name for plan in plans]
        self._next_batch_id = 0
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return ", ".join(f"{plan.name} at {source.address}" for plan, source in zip(self.plans, self.sources))

    def live(self, name: str):
        """The teacher server behind `name` (a store's filling teacher, or None for a store alone)."""
        source = self.sources[self.names.index(name)]
        return getattr(source, "teacher", source)

    def live_set(self) -> "TeacherSet":
        """The same teachers, each its teacher server where a store stands in front of it (held-out
        rows are asked of the teachers, never written into a store)."""
        return TeacherSet(self.plans, [getattr(source, "teacher", source) for source in self.sources], self.route)

    def rows_for(self, index: int, route: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The rows teacher `index` is sent: every row (None), or under field routing those with a
        token routed to it (a row is sent whole: the teacher needs its context)."""
        if route is None:
            return None
        return torch.nonzero(((route == index) & attention_mask.bool()).any(dim=1), as_tuple=False).squeeze(1)

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
               score_ids: torch.Tensor | None = None, route: torch.Tensor | None = None) -> Future:
        """Sends the [B, S] batch to every teacher it concerns before waiting for any; returns a
        future of its EnsembleOutput, resolved once every part is, or failed by the first part that
        fails (the error names the teacher)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.route and route is None:
            raise ValueError(f"--teacher-route field:{self.route}: a batch without its route")
        with self._lock:
            batch_id, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
        combined: Future = Future()
        result = EnsembleOutput(batch_id, {}, {}, route=route if self.route else None)
        parts: list[tuple[str, Future]] = []
        for index, (plan, source) in enumerate(zip(self.plans, self.sources)):
            rows = self.rows_for(index, route if self.route else None, attention_mask)
            result.rows[plan.name] = rows
            if rows is not None and rows.numel() == 0:
                result.outputs[plan.name] = None
                result.tokens[plan.name] = 0
                continue
            ids, mask = (input_ids, attention_mask) if rows is None else (input_ids[rows], attention_mask[rows])
            scored = None if score_ids is None else score_ids if rows is None else score_ids[rows]
            result.tokens[plan.name] = int(mask.sum())
            parts.append((plan.name, source.submit(ids, mask, score_ids=scored)))
        pending = [len(parts)]
        lock = threading.Lock()

        def arrived(name: str, part: Future) -> None:
            error = part.exception()
            with lock:
                result.resolved_at[name] = time.perf_counter()
                if combined.done():
                    return
                if error is not None:
                    combined.set_exception(_naming(error, name))
                    return
                result.outputs[name] = part.result()
                pending[0] -= 1
                if pending[0] == 0:
                    combined.set_result(result)

        if not parts:
            combined.set_result(result)
        for name, part in parts:
            part.add_done_callback(lambda done, name=name: arrived(name, done))
        return combined

    def close(self, timeout_s: float | None = None) -> None:
        errors = []
        for source in self.sources:
            try:
                source.close(timeout_s=timeout_s)
            except Exception as e:  # noqa: BLE001 - every teacher is left; the first error is raised
                errors.append(e)
        if errors:
            raise errors[0]


def _naming(error: BaseException, name: str) -> BaseException:
    """A teacher's error with the teacher's name in front (its type and status code kept)."""
    if isinstance(error, TeacherError):
        try:
            named = type(error)(f"teacher {name}: {error}", error.code)
        except TypeError:
            return error
        named.__cause__ = error
        return named
    return error


def open_teachers(cfg, open_one) -> TeacherSet:
    """Each teacher of `cfg.teacher_plans` opened by `open_one(plan)` (the run's own opening of one
    teacher or store: student_trainer/train.py), all of them or none."""
    sources = []
    try:
        for plan in cfg.teacher_plans:
            sources.append(open_one(plan))
            log.info("teacher %s", plan.describe())
    except BaseException:
        for source in sources:
            source.close(timeout_s=5)
        raise
    return TeacherSet(cfg.teacher_plans, sources, route=route_field(cfg.teacher_route))


# ---- the losses ------------------------------------------------------------------------------------------


def teacher_kd(settings, student: torch.Tensor, out: TeacherOutput, mask: torch.Tensor, head=None,
               matched_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The KD loss of the student's logits [B, S - 1, V] against one teacher's outputs for the same
    positions, with `settings`' loss settings (a TrainConfig, or a TeacherPlan: full logits or the
    top k, or the teacher's head applied to its final hidden state; divergence, temperature), or
    across tokenizers (gold, with the student ids `matched_ids` of the projection's columns, or uld)."""
    if settings.loss == "gold":
        return gold_loss(student, out.projected_probs[:, :-1], out.unmatched_mass[:, :-1], matched_ids,
                         out.unmatched_topk[:, :-1] if out.unmatched_topk is not None else None, mask,
                         chunk_tokens=settings.kd_chunk_tokens)
    if settings.loss == "uld":
        return uld_loss(student, out.sorted_probs[:, :-1], mask, chunk_tokens=settings.kd_chunk_tokens)
    options = dict(kind=settings.loss, temperature=settings.temperature, jsd_beta=settings.jsd_beta,
                   chunk_tokens=settings.kd_chunk_tokens)
    if settings.head_on_student:
        return kd_loss_from_hidden(student, out.final_hidden[:, :-1], head, mask, topk=settings.topk,
                                   tail=settings.topk_tail, **options)
    if settings.topk:
        return topk_kd_loss(student, out.topk_values[:, :-1], out.topk_indices[:, :-1], mask, tail=settings.topk_tail,
                            **options)
    return kd_loss(student, out.logits[:, :-1], mask, **options)


def mixture_member(plan: TeacherPlan, out: TeacherOutput, head=None, weight: float | None = None) -> MixtureTeacher:
    """One teacher's part of the mixture, from its outputs for positions [:, :-1]."""
    weight = plan.weight if weight is None else weight
    if plan.head_on_student:
        return MixtureTeacher(weight, hidden=out.final_hidden[:, :-1], head=head, temperature=plan.temperature,
                              topk=plan.topk)
    if plan.topk:
        return MixtureTeacher(weight, logprobs=out.topk_values[:, :-1], ids=out.topk_indices[:, :-1])
    return MixtureTeacher(weight, logits=out.logits[:, :-1], temperature=plan.temperature)


def _rows_of(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows is None else tensor[rows.to(tensor.device)]


def ensemble_kd(cfg, student: torch.Tensor, ens: EnsembleOutput, mask: torch.Tensor, heads: dict,
                matched: dict, *, per_teacher: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The combined KD loss of the student's logits [B, S - 1, V] (module docstring) and each
    teacher's own divergence over its tokens (for the metrics; computed without a gradient where the
    combination does not need it, and left out with `per_teacher=False`). `heads[name]`,
    `matched[name]`: each teacher's output head and matched student ids, where it has them."""
    plans = cfg.teacher_plans
    own: dict[str, float] = {}
    if ens.route is not None:
        targets = ens.route[:, 1:].to(mask.device)
        total = mask.sum()
        kd = student.new_zeros((), dtype=torch.float32)
        for index, plan in enumerate(plans):
            out, rows = ens.outputs[plan.name], ens.rows[plan.name]
            if out is None:
                continue
            mine = _rows_of(mask, rows) & (_rows_of(targets, rows) == index)
            tokens = mine.sum()
            if not bool(tokens):
                continue
            loss = teacher_kd(plan, _rows_of(student, rows), out, mine, heads.get(plan.name), matched.get(plan.name))
            kd = kd + plan.weight * loss * (tokens / total.clamp(min=1))
            own[plan.name] = loss.item()
        return kd, own
    if cfg.teacher_combine == "sum":
        total_weight = sum(plan.weight for plan in plans)
        kd = student.new_zeros((), dtype=torch.float32)
        for plan in plans:
            loss = teacher_kd(plan, student, ens.outputs[plan.name], mask, heads.get(plan.name), matched.get(plan.name))
            kd = kd + plan.weight / total_weight * loss
            own[plan.name] = loss.item()
        return kd, own
    members = [mixture_member(plan, ens.outputs[plan.name], heads.get(plan.name)) for plan in plans]
    kd = mixture_kd_loss(student, members, mask, kind=cfg.loss, temperature=cfg.temperature, jsd_beta=cfg.jsd_beta,
                         chunk_tokens=cfg.kd_chunk_tokens)
    if per_teacher:
        with torch.no_grad():
            for plan in plans:
                own[plan.name] = teacher_kd(plan, student, ens.outputs[plan.name], mask, heads.get(plan.name)).item()
    return kd, own


def step_metrics(names: list[str], per_micro: list[tuple[EnsembleOutput, dict[str, float]]]) -> dict[str, float]:
    """Per-teacher entries of a step's record: `kd/NAME` (the mean of its own divergence over the
    micro-batches that had its tokens), `teacher_wait_s/NAME` and `teacher_tokens/NAME` (summed)."""
    record: dict[str, float] = {}
    for name in names:
        losses = [own[name] for _, own in per_micro if name in own]
        if losses:
            record[f"kd/{name}"] = sum(losses) / len(losses)
        record[f"teacher_wait_s/{name}"] = sum(ens.waits.get(name, 0.0) for ens, _ in per_micro)
        record[f"teacher_tokens/{name}"] = sum(ens.tokens.get(name, 0) for ens, _ in per_micro)
    return record
