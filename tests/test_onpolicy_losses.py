"""The on-policy losses (student_trainer/losses.py) against references written the plain way.

`sampled_reverse_kl_loss`: value and gradient against autograd on float64 log-softmaxes, and its
two expectations checked exactly by enumerating every sequence of a small autoregressive pair.
`scored_kd_loss`: value and gradient against buckets built one position at a time, equal to the
full-vocabulary loss when the ids cover the vocabulary, and below it otherwise.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from student_trainer.losses import TAIL_FLOOR, kd_loss, sampled_reverse_kl_loss, scored_kd_loss

V = 6


def _inputs(seed: int, batch: int = 2, seq: int = 5, vocab: int = V):
    generator = torch.Generator().manual_seed(seed)
    student = (torch.randn(batch, seq, vocab, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    teacher = torch.randn(batch, seq, vocab, generator=generator, dtype=torch.float64) * 2
    mask = torch.rand(batch, seq, generator=generator) > 0.3
    mask[0, 0] = True
    return student, teacher, mask, generator


# ---- the sampled-token reverse KL ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("baseline", [True, False])
def test_sampled_reverse_kl_value_and_gradient_match_the_reference(temperature, baseline):
    student, teacher, mask, generator = _inputs(1, batch=3)
    tokens = torch.randint(0, V, (3, 5), generator=generator)
    teacher_logprobs = torch.log_softmax(teacher, -1).gather(-1, tokens[..., None])[..., 0]
    loss = sampled_reverse_kl_loss(student, tokens, teacher_logprobs, mask, temperature=temperature,
                                   baseline=baseline)
    (grad,) = torch.autograd.grad(loss, student)

    # Reference: position by position, log q of the sampled token, the ratio as a constant weight,
    # less the mean ratio of the other rows' tokens.
    log_q, ratio, row_of = [], [], []
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        log_q.append(torch.log_softmax(student[b, t] / temperature, -1)[tokens[b, t]])
        ratio.append((log_q[-1] - teacher_logprobs[b, t]).detach())
        row_of.append(int(b))
    surrogate = []
    for i in range(len(ratio)):
        others = [ratio[j] for j in range(len(ratio)) if row_of[j] != row_of[i]]
        weight = ratio[i] - (sum(others) / len(others) if baseline and others else 0.0)
        surrogate.append(weight * log_q[i])
    (want_grad,) = torch.autograd.grad(torch.stack(surrogate).mean(), student)
    torch.testing.assert_close(loss, torch.stack(ratio).mean())
    torch.testing.assert_close(grad, want_grad)
    assert grad[~mask].abs().max() == 0


def _toy(seed: int):
    """A two-token autoregressive pair over V ids: logits of the first token, and of the second given the first."""
    generator = torch.Generator().manual_seed(seed)
    student = [torch.randn(V, generator=generator, dtype=torch.float64).requires_grad_(),
               torch.randn(V, V, generator=generator, dtype=torch.float64).requires_grad_()]
    teacher = [torch.randn(V, generator=generator, dtype=torch.float64),
               torch.randn(V, V, generator=generator, dtype=torch.float64)]
    return student, teacher


def _sequence_logits(tables, x1):
    """[1, 2, V]: the logits that predict token 1 and token 2 (given x1)."""
    return torch.stack([tables[0], tables[1][x1]])[None]


def test_the_sampled_estimator_is_unbiased_on_an_exact_case():
    student, teacher = _toy(2)
    log_q1, log_p1 = torch.log_softmax(student[0], -1), torch.log_softmax(teacher[0], -1)
    log_q2, log_p2 = torch.log_softmax(student[1], -1), torch.log_softmax(teacher[1], -1)
    estimate, estimated_grad = torch.zeros((), dtype=torch.float64), [torch.zeros_like(s) for s in student]
    for x1, x2 in itertools.product(range(V), repeat=2):  # every sequence, weighted by its probability
        weight = (log_q1[x1] + log_q2[x1, x2]).exp().detach()
        tokens = torch.tensor([[x1, x2]])
        teacher_logprobs = torch.stack([log_p1[x1], log_p2[x1, x2]])[None]
        # Summed over the sequence's tokens (the loss is their mean).
        loss = 2 * sampled_reverse_kl_loss(_sequence_logits(student, x1), tokens, teacher_logprobs)
        estimate = estimate + weight * loss.detach()
        for total, grad in zip(estimated_grad, torch.autograd.grad(loss, student)):
            total += weight * grad

    # The value: KL(q || p) of whole sequences.
    sequence_kl = sum((log_q1[a] + log_q2[a, b]).exp() * (log_q1[a] + log_q2[a, b] - log_p1[a] - log_p2[a, b])
                      for a, b in itertools.product(range(V), repeat=2))
    torch.testing.assert_close(estimate, sequence_kl.detach())

    # The gradient: of the token-level reverse KL with the prefixes' distribution held fixed.
    def token_kl(log_q, log_p):
        return (log_q.exp() * (log_q - log_p)).sum(-1)

    token_level = token_kl(log_q1, log_p1) + (log_q1.exp().detach() * token_kl(log_q2, log_p2)).sum()
    for got, want in zip(estimated_grad, torch.autograd.grad(token_level, student, retain_graph=True)):
        torch.testing.assert_close(got, want)
    # ... which is not the whole sequence KL's: the first token's effect on the second is left out.
    full = torch.autograd.grad(sequence_kl, student)
    assert not torch.allclose(estimated_grad[0], full[0], atol=1e-3)


def test_the_baseline_keeps_the_gradient_unbiased():
    """Batches of two sequences, every pair enumerated: with the other row's mean log ratio as the
    baseline the expected gradient is still the token-level one."""
    v = 3
    generator = torch.Generator().manual_seed(9)
    student = [torch.randn(v, generator=generator, dtype=torch.float64).requires_grad_(),
               torch.randn(v, v, generator=generator, dtype=torch.float64).requires_grad_()]
    teacher = [torch.randn(v, generator=generator, dtype=torch.float64) * 3,
               torch.randn(v, v, generator=generator, dtype=torch.float64) * 3]
    log_q1, log_p1 = torch.log_softmax(student[0], -1), torch.log_softmax(teacher[0], -1)
    log_q2, log_p2 = torch.log_softmax(student[1], -1), torch.log_softmax(teacher[1], -1)
    sequences = list(itertools.product(range(v), repeat=2))
    means = {}
    for baseline in (False, True):
        mean = torch.zeros(v + v * v, dtype=torch.float64)
        for (a1, a2), (b1, b2) in itertools.product(sequences, repeat=2):
            weight = (log_q1[a1] + log_q2[a1, a2] + log_q1[b1] + log_q2[b1, b2]).exp().detach()
            logits = torch.stack([_sequence_logits(student, a1)[0], _sequence_logits(student, b1)[0]])
            tokens = torch.tensor([[a1, a2], [b1, b2]])
            teacher_logprobs = torch.stack([torch.stack([log_p1[a1], log_p2[a1, a2]]),
                                            torch.stack([log_p1[b1], log_p2[b1, b2]])])
            # Summed over the batch's four tokens, per sequence: the estimate of one sequence's gradient.
            loss = 2 * sampled_reverse_kl_loss(logits, tokens, teacher_logprobs, baseline=baseline)
            grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, student, retain_graph=True)])
            mean += weight * grad
        means[baseline] = mean

    def token_kl(log_q, log_p):
        return (log_q.exp() * (log_q - log_p)).sum(-1)

    token_level = token_kl(log_q1, log_p1) + (log_q1.exp().detach() * token_kl(log_q2, log_p2)).sum()
    want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(token_level, student)])
    for baseline, mean in means.items():
        torch.testing.assert_close(mean, want, msg=f"baseline={baseline}")


def test_sampled_estimates_average_to_the_reverse_kl():
    student, teacher = _toy(3)
    log_q1, log_p1 = torch.log_softmax(student[0], -1).detach(), torch.log_softmax(teacher[0], -1)
    log_q2, log_p2 = torch.log_softmax(student[1], -1).detach(), torch.log_softmax(teacher[1], -1)
    generator = torch.Generator().manual_seed(4)
    n = 20000
    x1 = torch.multinomial(log_q1.exp(), n, replacement=True, generator=generator)
    x2 = torch.multinomial(log_q2.exp()[x1], 1, generator=generator)[:, 0]
    logits = torch.stack([student[0].detach().expand(n, V), student[1].detach()[x1]], dim=1)
    teacher_logprobs = torch.stack([log_p1[x1], log_p2[x1, x2]], dim=1)
    both = 2 * sampled_reverse_kl_loss(logits, torch.stack([x1, x2], 1), teacher_logprobs)
    per_sequence = log_q1[x1] + log_q2[x1, x2] - teacher_logprobs.sum(1)
    exact = sum((log_q1[a] + log_q2[a, b]).exp() * (log_q1[a] + log_q2[a, b] - log_p1[a] - log_p2[a, b])
                for a, b in itertools.product(range(V), repeat=2))
    spread = per_sequence.std() / n ** 0.5
    assert abs(both - exact) < 4 * spread, (both, exact, spread)


def test_a_mask_that_selects_nothing_gives_a_connected_zero():
    student, teacher, _, _ = _inputs(5)
    zero = sampled_reverse_kl_loss(student, torch.zeros(2, 5, dtype=torch.int64), teacher[..., 0],
                                   torch.zeros(2, 5, dtype=torch.bool))
    zero.backward()
    assert zero.item() == 0 and student.grad.abs().max() == 0


# ---- divergences on the student's ids ----------------------------------------------------------------


def _reference_scored(student, ids, teacher_logprobs, mask, kind, temperature, beta):
    """One position at a time: the k ids' and the tail's probabilities, the divergence by its definition."""
    per_token = []
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        q_all = torch.softmax(student[b, t] / temperature, -1)
        q = q_all[ids[b, t]]
        p = teacher_logprobs[b, t].exp()
        if ids.shape[-1] < student.shape[-1]:
            q = torch.cat([q, 1 - q.sum(0, keepdim=True)])
            p = torch.cat([p, (1 - p.sum(0, keepdim=True)).clamp_min(TAIL_FLOOR)])
        if kind == "forward_kl":
            value = (p * (p.log() - q.log())).sum()
        elif kind == "reverse_kl":
            value = (q * (q.log() - p.log())).sum()
        else:
            m = beta * p + (1 - beta) * q
            value = beta * (p * (p / m).log()).sum() + (1 - beta) * (q * (q / m).log()).sum()
        per_token.append(value)
    return torch.stack(per_token).mean() * temperature ** 2


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_scored_kd_value_and_gradient_match_the_reference(kind, temperature):
    student, teacher, mask, generator = _inputs(6, vocab=9)
    ids = torch.stack([torch.randperm(9, generator=generator)[:3] for _ in range(10)]).view(2, 5, 3)
    teacher_logprobs = torch.log_softmax(teacher / temperature, -1).gather(-1, ids)
    loss = scored_kd_loss(student, ids, teacher_logprobs, mask, kind=kind, temperature=temperature, jsd_beta=0.3)
    (grad,) = torch.autograd.grad(loss, student)
    want = _reference_scored(student, ids, teacher_logprobs, mask, kind, temperature, 0.3)
    (want_grad,) = torch.autograd.grad(want, student)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_ids_covering_the_vocabulary_give_the_full_divergence_and_fewer_a_lower_bound(kind):
    student, teacher, mask, generator = _inputs(7)
    everything = torch.stack([torch.randperm(V, generator=generator) for _ in range(10)]).view(2, 5, V)
    full = kd_loss(student, teacher, mask, kind=kind, jsd_beta=0.3)
    scored = scored_kd_loss(student, everything, torch.log_softmax(teacher, -1).gather(-1, everything), mask,
                            kind=kind, jsd_beta=0.3)
    torch.testing.assert_close(scored, full.to(scored.dtype))
    fewer = everything[..., :2]
    assert scored_kd_loss(student, fewer, torch.log_softmax(teacher, -1).gather(-1, fewer), mask, kind=kind,
                          jsd_beta=0.3) < full


def test_repeated_or_misshapen_ids_are_refused():
    student, teacher, mask, _ = _inputs(8)
    ids = torch.zeros(2, 5, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="repeat a vocabulary index"):
        scored_kd_loss(student, ids, teacher[..., :2], mask)
    with pytest.raises(ValueError, match=r"must both be \[batch, seq, k\]"):
        scored_kd_loss(student, ids[:, :4], teacher[:, :4, :2], mask)
