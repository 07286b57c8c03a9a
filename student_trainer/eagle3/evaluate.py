"""Acceptance length: how many tokens a teacher forward yields when the draft proposes.

Chain speculative decoding, greedy, on held-out prompts. Each round the draft proposes K tokens
after the sequence so far; one teacher forward over the sequence and the proposals gives the
teacher's greedy token after every one of them; the proposals are accepted up to the first that
differs from the teacher's, and the teacher's own token there is appended too. A round thus
yields accepted + 1 tokens per teacher forward: its mean is the *mean acceptance length* that
EAGLE-3 and SpecForge report (1.0 without a draft). The tokens generated are the teacher's
greedy decoding whatever the draft proposes (the check is exact).

*Acceptance rate at position i* is the share of rounds whose i-th proposal was accepted, as
vLLM counts it (`num_accepted_tokens_per_pos / num_drafts`).

The teacher server has no KV cache: each round is a forward over the whole sequence. That
costs the teacher more than a serving engine would spend, not the figures.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from distill_common.outputs import Argmax, AuxHiddenStates
from student_trainer.client import TeacherClient
from student_trainer.data import DataError, read_jsonl, tokenize_records
from student_trainer.eagle3.config import Eagle3EvalConfig
from student_trainer.eagle3.model import Eagle3Draft, aux_layers_of
from student_trainer.train import teacher_result

log = logging.getLogger(__name__)


@dataclass
class Acceptance:
    steps: int  # K: proposals per round
    accepted: list[int] = field(default_factory=list)  # per round: proposals accepted (0 .. K)
    generated: list[list[int]] = field(default_factory=list)  # per prompt: the tokens decoded

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying teacher forward: accepted proposals plus the teacher's own token."""
        return sum(a + 1 for a in self.accepted) / max(1, self.rounds)

    @property
    def rates(self) -> list[float]:
        """Per position i (1 .. K): the share of rounds whose i-th proposal was accepted."""
        return [sum(a > i for a in self.accepted) / max(1, self.rounds) for i in range(self.steps)]

    def report(self) -> str:
        lines = [f"acceptance over {len(self.generated)} held-out prompts, {self.rounds} teacher forwards verifying "
                 f"{self.steps} proposals each:"]
        lines += [f"  position {i + 1}: {rate:.3f}" for i, rate in enumerate(self.rates)]
        lines.append(f"mean acceptance length: {self.mean_acceptance_length:.2f} tokens per teacher forward "
                     f"(without a draft: 1.00)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {**asdict(self), "rounds": self.rounds, "rates": self.rates,
                "mean_acceptance_length": self.mean_acceptance_length}


def prompts_from(path: str, tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    """Up to `count` prompts: a text record's first `prompt_tokens` tokens, or a prompt or
    conversation up to where its loss mask starts (its last `prompt_tokens` tokens)."""
    prompts = []
    for _, record in read_jsonl(path):
        ((ids, mask),) = tokenize_records([record], tokenizer)
        if mask and mask[0] == 1:
            prompt = ids[:prompt_tokens]
        else:
            first = mask.index(1) if 1 in mask else len(ids)
            prompt = ids[:first][-prompt_tokens:]
        if len(prompt) >= 2:
            prompts.append(prompt)
        if len(prompts) == count:
            break
    return prompts


def decode(teacher: TeacherClient, draft: Eagle3Draft, prompt: list[int], new_tokens: int, steps: int,
           timeout_s: float, acceptance: Acceptance) -> list[int]:
    """Greedy decoding of `new_tokens` tokens after `prompt`, verifying the draft's chains.

    `timeout_s`: the longest wait for one teacher forward (then TeacherUnavailable)."""
    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    ids = torch.tensor([prompt])
    out = teacher_result(teacher, teacher.submit(ids), timeout_s)
    aux, ids = out.aux_hidden_states, torch.cat([ids, out.argmax[:, -1:].long().cpu()], dim=1)
    limit = teacher.info.max_seq_len
    while ids.shape[1] - len(prompt) < new_tokens:
        length = ids.shape[1]
        if length + steps > limit:
            log.warning("stopped a prompt at %d tokens: the teacher's --max-seq-len is %d", length, limit)
            break
        # The states of every token but the last, which the teacher chose from the states before it.
        proposals = draft.propose(aux[:, :length - 1].to(device, dtype), ids.to(device), steps).cpu()
        out = teacher_result(teacher, teacher.submit(torch.cat([ids, proposals], dim=1)), timeout_s)
        greedy = out.argmax[0, length - 1:].long().cpu()  # the teacher's token after ids, then after each proposal
        accepted = 0
        while accepted < steps and proposals[0, accepted] == greedy[accepted]:
            accepted += 1
        acceptance.accepted.append(accepted)
        ids = torch.cat([ids, proposals[:, :accepted], greedy[accepted:accepted + 1][None]], dim=1)
        aux = out.aux_hidden_states[:, :length + accepted]
    generated = ids[0, len(prompt):len(prompt) + new_tokens].tolist()
    acceptance.generated.append(generated)
    return generated


def evaluate_acceptance(cfg: Eagle3EvalConfig) -> Acceptance:
    from transformers import AutoTokenizer

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    draft = Eagle3Draft.from_pretrained(cfg.draft, device=device).eval()
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.draft)
    prompts = prompts_from(cfg.data, tokenizer, cfg.prompts, cfg.prompt_tokens)
    if not prompts:
        raise DataError(f"--data {cfg.data} has no record with a prompt of 2 tokens or more: give held-out JSONL "
                        "with text, prompt/completion or messages records")
    acceptance = Acceptance(cfg.steps)
    with TeacherClient(cfg.teacher, device, outputs=(AuxHiddenStates(aux_layers_of(draft.config)), Argmax()),
                       tokenizer=tokenizer, vocab_size=draft.config.vocab_size, job_id="eagle3-eval",
                       transfer_timeout_s=cfg.teacher_timeout_s, reconnect_timeout_s=cfg.teacher_reconnect_timeout_s,
                       max_resubmits=cfg.teacher_max_resubmits, refuse_quantized=cfg.refuse_fp8_teacher,
                       max_teacher_kl=cfg.max_teacher_kl, tls_ca=cfg.teacher_tls,
                       tls_cert=cfg.teacher_tls_cert or None, tls_key=cfg.teacher_tls_key or None) as teacher:
        # A forward may wait out a reconnect as well as its transfer, as in training.
        timeout_s = cfg.teacher_timeout_s + cfg.teacher_reconnect_timeout_s
        for prompt in prompts:
            decode(teacher, draft, prompt, cfg.new_tokens, cfg.steps, timeout_s, acceptance)
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(acceptance.to_json(), indent=2) + "\n")
    return acceptance
