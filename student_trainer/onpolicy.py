"""On-policy distillation: the student completes prompts, the teacher scores the completions.

GKD (Agarwal et al., 2024): with probability λ (`--on-policy-fraction`) a batch's completions
are sampled from the student being trained, otherwise they are the data's reference
completions. The losses (student_trainer/losses.py):

- on sampled completions, `--on-policy-loss sampled` (default): the per-token reverse KL on the
  sampled tokens, from the teacher's log-probability of each (`NextTokenLogprobs`: 4 bytes a
  token); `divergence`: the `--loss` divergence on the support below;
- on reference completions, always the `--loss` divergence (plus `(1 - α)` cross-entropy, α =
  `--kd-weight`), on the student's own top `--student-topk` ids and the rest, scored exactly by
  the teacher (`ScoredLogprobs`: 4 bytes a token per id), or on the teacher's full logits.

Where this runs in the loop (student_trainer/train.py): `OnPolicyBatches` is the loop's batch
source. The prefetcher draws the next batch, so the next batch's generation runs while the
teacher scores the last: a sampled batch comes from the student as it was `--prefetch` steps
before it is trained on (one step with the default overlap of 1). Generation is batched, with
the KV cache, under `torch.no_grad` on the model itself (not its DDP wrapper). Each batch's
sampling is seeded by (--seed, rank, epoch, position): DDP ranks sample independently, and a
resumed run samples what the uninterrupted one would have; the batches already drawn ahead at
a checkpoint are saved with it and submitted again first.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from distill_common.outputs import Logits, NextTokenLogprobs, Output, ScoredLogprobs, TeacherOutput
from distill_common.settings import ConfigError
from student_trainer.config import TrainConfig
from student_trainer.data import BatchIterator, PromptDataset, prompt_lengths, tokenize_record
from student_trainer.losses import (MixtureTeacher, kd_loss, mixture_kd_loss, sampled_reverse_kl_loss,
                                    scored_kd_loss)

log = logging.getLogger(__name__)


# ---- what the teacher is asked, and the losses --------------------------------------------------------


def samples_with_divergence(cfg: TrainConfig) -> bool:
    """Whether some batches use the --loss divergence: reference batches, or sampled ones asked to."""
    return cfg.on_policy_fraction < 1 or cfg.on_policy_loss == "divergence"


def teacher_outputs(cfg: TrainConfig, temperature: float | None = None) -> tuple[Output, ...]:
    """The teacher's log-probability of each next token for the sampled-token loss; its
    log-probabilities at the student's top k (or its full logits) for the divergence; at
    `temperature` (default --temperature; one of several teachers: its own)."""
    temperature = cfg.temperature if temperature is None else temperature
    kinds: list[Output] = []
    if cfg.on_policy_fraction > 0 and cfg.on_policy_loss == "sampled":
        kinds.append(NextTokenLogprobs(temperature))
    if samples_with_divergence(cfg):
        kinds.append(ScoredLogprobs(cfg.student_topk, temperature) if cfg.student_topk else Logits())
    return tuple(kinds)


def distill_losses(cfg: TrainConfig, logits: torch.Tensor, batch: dict, out: TeacherOutput | None) -> dict:
    """The loss of one on-policy micro-batch: sampled completions are trained on the teacher
    alone; reference completions on α·KD + (1 − α)·CE (KD over the completion's tokens)."""
    device = logits.device
    targets = batch["input_ids"][:, 1:].to(device)
    mask = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).to(device).bool()
    student = logits[:, :-1]
    sampled = bool(batch["on_policy"])
    losses = {"on_policy": torch.tensor(float(sampled))}
    if not sampled:
        losses["ce"] = F.cross_entropy(student[mask].float(), targets[mask]) if mask.any() else student.sum() * 0.0
    if not cfg.uses_logits:
        losses["loss"] = losses["ce"]
        return losses
    if cfg.several_teachers:
        losses["kd"], own = several_teachers_kd(cfg, student, targets, batch, out, mask, sampled)
        losses.update({f"kd/{name}": torch.tensor(value) for name, value in own.items()})
    elif sampled and cfg.on_policy_loss == "sampled":
        losses["kd"] = sampled_reverse_kl_loss(student, targets, out.next_token_logprobs[:, :-1].to(device), mask,
                                               temperature=cfg.sample_temperature)
    elif cfg.student_topk:
        losses["kd"] = scored_kd_loss(student, batch["score_ids"][:, :-1].to(device),
                                      out.scored_logprobs[:, :-1].to(device), mask, kind=cfg.loss,
                                      temperature=cfg.temperature, jsd_beta=cfg.jsd_beta,
                                      chunk_tokens=cfg.kd_chunk_tokens)
    else:
        losses["kd"] = kd_loss(student, out.logits[:, :-1], mask, kind=cfg.loss, temperature=cfg.temperature,
                               jsd_beta=cfg.jsd_beta, chunk_tokens=cfg.kd_chunk_tokens)
    losses["loss"] = losses["kd"] if sampled else cfg.kd_weight * losses["kd"] + (1 - cfg.kd_weight) * losses["ce"]
    return losses


def several_teachers_kd(cfg: TrainConfig, student: torch.Tensor, targets: torch.Tensor, batch: dict, ens,
                        mask: torch.Tensor, sampled: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """The on-policy KD loss against several teachers (every teacher scores every batch) and each
    one's own, w~_i = w_i / sum_j w_j:

    - sampled tokens: the sampled-token loss against log p = sum_i w~_i log p_i(x) (`sum`: its
      value and gradient are the weighted mean of each teacher's, being linear in log p) or
      log sum_i w~_i p_i(x) (`mixture`: the mixture's log-probability of the token);
    - the divergence on the student's top k (or the full logits): `sum` of each teacher's at its
      temperature, or to the mixture at --temperature, exact on the k ids every teacher scored and
      the rest (student_trainer/losses.py: `mixture_kd_loss`).
    """
    plans = cfg.teacher_plans
    outs = [ens.outputs[plan.name] for plan in plans]
    log_weights = torch.tensor([plan.weight for plan in plans], dtype=torch.float64)
    log_weights = (log_weights / log_weights.sum()).log().tolist()
    own: dict[str, float] = {}
    device = student.device
    if sampled and cfg.on_policy_loss == "sampled":
        each = torch.stack([out.next_token_logprobs[:, :-1].to(device) for out in outs])
        weights = torch.tensor(log_weights, dtype=torch.float64, device=device)
        combined = ((weights.exp()[:, None, None] * each.double()).sum(0) if cfg.teacher_combine == "sum"
                    else (weights[:, None, None] + each.double()).logsumexp(0))
        with torch.no_grad():
            for plan, logprobs in zip(plans, each):
                own[plan.name] = sampled_reverse_kl_loss(student, targets, logprobs, mask,
                                                         temperature=cfg.sample_temperature).item()
        return sampled_reverse_kl_loss(student, targets, combined.to(each.dtype), mask,
                                       temperature=cfg.sample_temperature), own

    def each_kd(plan, out):  # one teacher's divergence, at its own settings
        options = dict(kind=plan.loss, temperature=plan.temperature, jsd_beta=cfg.jsd_beta,
                       chunk_tokens=cfg.kd_chunk_tokens)
        if cfg.student_topk:
            return scored_kd_loss(student, batch["score_ids"][:, :-1].to(device),
                                  out.scored_logprobs[:, :-1].to(device), mask, **options)
        return kd_loss(student, out.logits[:, :-1], mask, **options)

    if cfg.teacher_combine == "sum":
        kd = student.new_zeros((), dtype=torch.float32)
        for plan, out, log_weight in zip(plans, outs, log_weights):
            loss = each_kd(plan, out)
            kd = kd + math.exp(log_weight) * loss
            own[plan.name] = loss.item()
        return kd, own
    if cfg.student_topk:
        ids = batch["score_ids"][:, :-1].to(device)
        members = [MixtureTeacher(plan.weight, logprobs=out.scored_logprobs[:, :-1].to(device), ids=ids)
                   for plan, out in zip(plans, outs)]
    else:
        members = [MixtureTeacher(plan.weight, logits=out.logits[:, :-1], temperature=plan.temperature)
                   for plan, out in zip(plans, outs)]
    kd = mixture_kd_loss(student, members, mask, kind=cfg.loss, temperature=cfg.temperature, jsd_beta=cfg.jsd_beta,
                         chunk_tokens=cfg.kd_chunk_tokens)
    with torch.no_grad():
        for plan, out in zip(plans, outs):
            own[plan.name] = each_kd(plan, out).item()
    return kd, own


# ---- sampling ------------------------------------------------------------------------------------------


def stop_token_ids(tokenizer, extra: str = "") -> list[int]:
    """What ends a sampled completion: eos, the chat template's end of turn (the last trained
    token of a rendered assistant message, when it is a special token), and `extra`
    (comma-separated tokens, --stop-tokens)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if getattr(tokenizer, "chat_template", None):
        try:
            rendered, mask = tokenize_record({"messages": [{"role": "user", "content": "1"},
                                                           {"role": "assistant", "content": "2"}]}, tokenizer)
            trained = [token for token, flag in zip(rendered, mask) if flag]
            if trained and trained[-1] in tokenizer.all_special_ids:
                ids.append(trained[-1])
        except Exception as e:  # a template this probe does not fit: eos and --stop-tokens only
            log.warning("could not find the chat template's end of turn (%s): stopping at eos and --stop-tokens", e)
    for token in filter(None, (t.strip() for t in extra.split(","))):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"--stop-tokens {token!r} is not a token of the tokenizer: give tokens as the "
                              "tokenizer spells them, e.g. <|im_end|>")
        ids.append(token_id)
    if not ids:
        raise ConfigError("the tokenizer has no eos token and --stop-tokens is empty: nothing would end a sample")
    return sorted(set(ids))


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row: the most likely at temperature 0, else a sample of
    softmax(logits / temperature) restricted to the smallest set holding `top_p` of its mass."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _cache_argument(model) -> str:
    """The name under which this model's forward takes its KV cache: transformers renamed
    `past_key_values` to `cache` (a name an older forward would silently swallow in **kwargs)."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, prompts: list[torch.Tensor], *, max_new_tokens: int, temperature: float, top_p: float,
           stop_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
           topk: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Completes each prompt (1-D token ids) by sampling, batched, with the KV cache.

    Prompts are left-padded, with position ids counted from each one's first token (as a
    right-padded training batch sees them). A completion ends after its first stop token, or at
    `max_new_tokens`. Returns each completion's ids and, with `topk`, the student's top `topk`
    ids at the position before each of its tokens ([n, topk]: what it would have ranked first).
    """
    device = next(model.parameters()).device
    rows, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, longest), pad_id, dtype=torch.int64, device=device)
    mask = torch.zeros(rows, longest, dtype=torch.int64, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = prompt.to(device)
        mask[row, longest - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(stop_ids, device=device)
    from transformers import DynamicCache

    cache = {_cache_argument(model): DynamicCache()}  # filled in place by each forward
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
        tokens, ranked = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.zeros(rows, dtype=torch.int64, device=device)
        for step in range(max_new_tokens):
            logits = out.logits[:, -1]
            if topk:
                ranked.append(logits.topk(topk, dim=-1).indices)
            token = _pick(logits, temperature, top_p, generator)
            tokens.append(token)
            lengths += ~done
            done |= torch.isin(token, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                        **cache)
    finally:
        model.train(was_training)
    generated = torch.stack(tokens, dim=1).cpu()
    lengths = lengths.cpu()
    completions = [generated[row, :lengths[row]] for row in range(rows)]
    if not topk:
        return completions, None
    ranked_ids = torch.stack(ranked, dim=1).cpu()
    return completions, [ranked_ids[row, :lengths[row]] for row in range(rows)]


def batch_seed(seed: int, rank: int, epoch: int, position: int) -> int:
    """The sampling seed of one rank's batch: independent across ranks, the same after a resume."""
    digest = hashlib.sha256(f"on-policy:{seed}:{rank}:{epoch}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class OnPolicyBatches:
    """The training batches of on-policy mode: prompts from a PromptDataset, completed by the
    student (with probability λ) or by their references.

    Each batch is a dict: `input_ids`, `attention_mask`, `loss_mask` [B, L] (prompt then
    completion, right-padded to the longest row; the loss mask on the completion),
    `on_policy` (whether the completions were sampled), and with `--student-topk K`,
    `score_ids` [B, L, K]: the student's top K at each position, the ids the teacher scores.
    """

    def __init__(self, prompts: BatchIterator, model, cfg: TrainConfig, *, stop_ids: list[int], pad_id: int,
                 rank: int):
        self.prompts, self.model, self.cfg = prompts, model, cfg
        self.stop_ids, self.pad_id, self.rank = stop_ids, pad_id, rank
        self.device = next(model.parameters()).device

    def __iter__(self) -> "OnPolicyBatches":
        return self

    def __next__(self) -> dict:
        epoch, position = self.prompts.epoch, self.prompts.position
        reference = next(self.prompts)
        seed = batch_seed(self.cfg.seed, self.rank, epoch, position)
        coin = torch.Generator().manual_seed(seed)
        if torch.rand((), generator=coin) < self.cfg.on_policy_fraction:
            generator = torch.Generator(self.device).manual_seed(seed)
            return self.sampled(reference, generator)
        return self.with_references(reference)

    def sampled(self, reference: dict, generator: torch.Generator) -> dict:
        cfg = self.cfg
        lengths = prompt_lengths(reference["loss_mask"])
        prompts = [reference["input_ids"][row, :lengths[row]] for row in range(len(lengths))]
        completions, ranked = sample(self.model, prompts, max_new_tokens=cfg.max_new_tokens,
                                     temperature=cfg.sample_temperature, top_p=cfg.top_p, stop_ids=self.stop_ids,
                                     pad_id=self.pad_id, generator=generator, topk=cfg.student_topk)
        seq = max(len(p) + len(c) for p, c in zip(prompts, completions))
        batch = {name: torch.zeros(len(prompts), seq, dtype=torch.int64)
                 for name in ("input_ids", "attention_mask", "loss_mask")}
        batch["input_ids"].fill_(self.pad_id)
        if ranked is not None:
            batch["score_ids"] = torch.zeros(len(prompts), seq, cfg.student_topk, dtype=torch.int64)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            start, end = len(prompt), len(prompt) + len(completion)
            batch["input_ids"][row, :end] = torch.cat([prompt, completion])
            batch["attention_mask"][row, :end] = 1
            batch["loss_mask"][row, start:end] = 1
            if ranked is not None:  # position t ranks the candidates for token t + 1
                batch["score_ids"][row, start - 1:end - 1] = ranked[row]
        batch["on_policy"] = True
        return batch

    @torch.no_grad()
    def with_references(self, reference: dict) -> dict:
        seq = int(reference["attention_mask"].sum(1).max())
        batch = {name: reference[name][:, :seq] for name in ("input_ids", "attention_mask", "loss_mask")}
        batch["on_policy"] = False
        if self.cfg.student_topk and self.cfg.uses_logits:
            was_training = self.model.training
            self.model.eval()
            try:
                logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                    attention_mask=batch["attention_mask"].to(self.device)).logits
            finally:
                self.model.train(was_training)
            batch["score_ids"] = logits.topk(self.cfg.student_topk, dim=-1).indices.cpu()
        return batch

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


# ---- held-out scores --------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, dataset: PromptDataset, cfg: TrainConfig, device: torch.device, stop_ids: list[int],
             pad_id: int) -> dict[str, float]:
    """Held-out scores of the prompts: "eval_ce", the cross-entropy per token of the reference
    completions, and "eval_exact_match", the share of prompts whose greedy completion is the
    reference completion token for token (up to and including its first stop token)."""
    ce_sum, tokens, matches = 0.0, 0, 0
    stops = set(stop_ids)
    for start in range(0, len(dataset), cfg.batch_size):
        ids = dataset.input_ids[start:start + cfg.batch_size]
        attention = dataset.attention_mask[start:start + cfg.batch_size]
        loss_mask = dataset.loss_mask[start:start + cfg.batch_size]
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits[:, :-1]
        mask = (loss_mask[:, 1:] * attention[:, 1:]).to(device).bool()
        ce_sum += F.cross_entropy(logits[mask].float(), ids[:, 1:].to(device)[mask], reduction="sum").item()
        tokens += int(mask.sum())
        lengths = prompt_lengths(loss_mask)
        prompts = [ids[row, :lengths[row]] for row in range(len(ids))]
        completions, _ = sample(model, prompts, max_new_tokens=cfg.max_new_tokens, temperature=0.0, top_p=1.0,
                                stop_ids=stop_ids, pad_id=pad_id)
        for row, completion in enumerate(completions):
            reference = ids[row, lengths[row]:int(attention[row].sum())].tolist()
            end = next((i for i, token in enumerate(reference) if token in stops), len(reference) - 1)
            matches += completion.tolist() == reference[:end + 1]
    return {"eval_ce": ce_sum / max(tokens, 1), "eval_exact_match": matches / len(dataset)}
