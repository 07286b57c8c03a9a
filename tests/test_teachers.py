"""Several teachers, the parts that need no server: the mixture loss against the mixture written
out the plain way (value and gradient), the teachers' specs, and the data's routes.

The served end of it (two real teacher servers, a training run against a local reference, a
teacher killed mid-run) is tests/test_several_teachers.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from distill_common.outputs import OutputHead
from distill_common.settings import ConfigError
from student_trainer.config import TrainConfig
from student_trainer.losses import MixtureTeacher, kd_loss, mixture_kd_loss, topk_kd_loss
from student_trainer.teachers import TeacherSpec, read_teacher_specs
from tests.helpers import divergence

B, S, V = 2, 5, 11


def plain_mixture_loss(student, teachers, mask, kind, temperature, beta=0.5):
    """mean over masked positions of D(m, q) * T², m = sum_i w_i p_i over the ids every teacher is
    known at, one by one, and the rest as one outcome (all ids when every teacher is known at all).

    `teachers`: (weight, full probabilities [B, S, V], ids known [B, S, V] bool or None)."""
    total = sum(w for w, _, _ in teachers)
    q_all = torch.softmax(student / temperature, dim=-1)
    losses = []
    for b in range(student.shape[0]):
        for s in range(student.shape[1]):
            if not mask[b, s]:
                continue
            m = sum(w / total * p[b, s] for w, p, _ in teachers)
            known = torch.ones(student.shape[-1], dtype=torch.bool)
            for _, _, k in teachers:
                if k is not None:
                    known &= k[b, s]
            q = q_all[b, s]
            if bool(known.all()):
                losses.append(divergence(m, q, kind, beta))
            else:
                p_buckets = torch.cat([m[known], (1 - m[known].sum()).reshape(1)])
                q_buckets = torch.cat([q[known], (1 - q[known].sum()).reshape(1)])
                losses.append(divergence(p_buckets, q_buckets, kind, beta))
    return torch.stack(losses).mean() * temperature ** 2


def teacher_logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(B, S, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def topk_of(logits: torch.Tensor, k: int, temperature: float):
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    known = torch.zeros_like(log_p, dtype=torch.bool).scatter_(-1, ids, True)
    return values, ids, log_p.exp(), known


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("case", ["full", "topk", "mixed", "head"])
def test_mixture_equals_the_plain_mixture_value_and_gradient(kind, case):
    student = teacher_logits(100, scale=1.5).requires_grad_(True)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 3:] = False
    a, b, c = teacher_logits(1), teacher_logits(2), teacher_logits(3)
    temperature = 1.7
    if case == "full":  # each teacher at its own temperature, the student at the mixture's
        members = [MixtureTeacher(2.0, logits=a, temperature=1.0), MixtureTeacher(1.0, logits=b, temperature=2.5)]
        plain = [(2.0, torch.softmax(a, -1), None), (1.0, torch.softmax(b / 2.5, -1), None)]
    elif case == "topk":  # three top-k teachers: exact on the ids all three sent, and the rest
        members, plain = [], []
        for weight, logits, k in ((1.0, a, 7), (3.0, b, 8), (0.5, c, 9)):
            values, ids, p, known = topk_of(logits, k, 1.0)
            members.append(MixtureTeacher(weight, logprobs=values, ids=ids.int()))
            plain.append((weight, p, known))
    elif case == "mixed":  # a full teacher is known everywhere: the top-k one's ids decide
        values, ids, p, known = topk_of(b, 6, 2.0)
        members = [MixtureTeacher(1.0, logits=a, temperature=1.5), MixtureTeacher(1.0, logprobs=values, ids=ids)]
        plain = [(1.0, torch.softmax(a / 1.5, -1), None), (1.0, p, known)]
    else:  # heads on the student: full, and its top k
        hidden = torch.randn(B, S, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        weight = torch.randn(V, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 2
        head = OutputHead(weight)
        head_logits = hidden @ weight.T
        members = [MixtureTeacher(1.0, hidden=hidden, head=head, temperature=2.0),
                   MixtureTeacher(2.0, hidden=hidden, head=head, temperature=1.0, topk=5), ]
        _, _, p, known = topk_of(head_logits, 5, 1.0)
        plain = [(1.0, torch.softmax(head_logits / 2.0, -1), None), (2.0, p, known)]
    got = mixture_kd_loss(student, members, mask, kind=kind, temperature=temperature, chunk_tokens=3)
    (got_grad,) = torch.autograd.grad(got, student)
    want = plain_mixture_loss(student, plain, mask, kind, temperature)
    (want_grad,) = torch.autograd.grad(want, student)
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(got_grad, want_grad, rtol=1e-7, atol=1e-12), (got_grad - want_grad).abs().max()
    assert not got_grad[1, 3:].any()  # masked positions get no gradient


def test_a_mixture_of_one_is_that_teachers_loss():
    student = teacher_logits(5, scale=1.0).float().requires_grad_(True)
    logits = teacher_logits(6).float()
    values, ids, _, _ = topk_of(logits, 4, 1.0)
    for members, alone in (
            ([MixtureTeacher(3.0, logprobs=values, ids=ids)], topk_kd_loss(student, values, ids, tail="bucket")),
            ([MixtureTeacher(0.2, logits=logits)], kd_loss(student, logits))):
        got = mixture_kd_loss(student, members)
        assert got.item() == pytest.approx(alone.item(), rel=1e-5)
        assert torch.allclose(torch.autograd.grad(got, student)[0], torch.autograd.grad(alone, student)[0],
                              rtol=1e-4, atol=1e-7)


def test_forward_kl_summed_is_the_mixtures_plus_a_constant():
    """sum_i w_i KL(p_i || q) = KL(m || q) + H(m) - sum_i w_i H(p_i): the same gradient (docs/training.md)."""
    student = teacher_logits(9, scale=1.0).requires_grad_(True)
    a, b = teacher_logits(10), teacher_logits(11)
    summed = 0.25 * kd_loss(student, a, temperature=2.0) + 0.75 * kd_loss(student, b, temperature=2.0)
    mixed = mixture_kd_loss(student, [MixtureTeacher(1.0, logits=a, temperature=2.0),
                                      MixtureTeacher(3.0, logits=b, temperature=2.0)], temperature=2.0)
    p_a, p_b = torch.softmax(a / 2, -1), torch.softmax(b / 2, -1)
    m = 0.25 * p_a + 0.75 * p_b

    def entropy(p):
        return -(p * p.log()).sum(-1).mean()

    gap = (entropy(m) - 0.25 * entropy(p_a) - 0.75 * entropy(p_b)) * 4  # times T²
    assert (summed - mixed).item() == pytest.approx(gap.item(), rel=1e-9)
    assert torch.allclose(torch.autograd.grad(summed, student)[0], torch.autograd.grad(mixed, student)[0],
                          rtol=1e-9, atol=1e-14)


def test_a_mixture_refuses_what_it_cannot_use():
    student = teacher_logits(5).float()
    logits = teacher_logits(6).float()
    with pytest.raises(ValueError, match="at least one"):
        mixture_kd_loss(student, [])
    with pytest.raises(ValueError, match="exactly one of"):
        mixture_kd_loss(student, [MixtureTeacher(1.0, logits=logits, hidden=logits)])
    with pytest.raises(ValueError, match="weights must be finite and > 0"):
        mixture_kd_loss(student, [MixtureTeacher(0.0, logits=logits)])
    with pytest.raises(ValueError, match="the same batch and vocabulary"):
        mixture_kd_loss(student, [MixtureTeacher(1.0, logits=logits[:, :, :-1])])
    values, ids, _, _ = topk_of(logits, 3, 1.0)
    with pytest.raises(ValueError, match="distinct"):
        mixture_kd_loss(student, [MixtureTeacher(1.0, logprobs=values, ids=ids.clone().fill_(2))])


# ---- the specs ---------------------------------------------------------------------------------


def config(*specs: str, **flags) -> TrainConfig:
    return TrainConfig(model="m", data="d", kd_weight=0.5, teacher_spec=list(specs), **flags)


def test_a_spec_reads_its_keys_and_takes_the_flags_for_the_others():
    cfg = config("name=code,address=h1:1,h2:2,weight=2,kind=topk,topk=16,temperature=2",
                 "name=prose,store=/s,kind=head", topk=4, temperature=1.5, loss="reverse_kl")
    code, prose = cfg.teacher_plans
    assert (code.address, code.weight, code.topk, code.temperature, code.loss) == ("h1:1,h2:2", 2.0, 16, 2.0,
                                                                                 "reverse_kl")
    assert (prose.store, prose.head_on_student, prose.topk, prose.temperature) == ("/s", True, 4, 1.5)
    assert [type(o).__name__ for o in code.outputs() + prose.outputs()] == ["TopK", "FinalHidden"]


def test_a_teachers_file_lists_them(tmp_path):
    path = tmp_path / "teachers.json"
    path.write_text(json.dumps([{"name": "a", "address": "h:1", "weight": 0.25}, {"name": "b", "address": "h:2"}]))
    cfg = TrainConfig(model="m", data="d", teachers=str(path), teacher_combine="mixture")
    assert [(p.name, p.weight) for p in cfg.teacher_plans] == [("a", 0.25), ("b", 1.0)]


@pytest.mark.parametrize("specs, flags, words", [
    (["address=h:1"], {}, "give the teacher a name"),
    (["name=a,address=h:1", "name=a,address=h:2"], {}, "given twice"),
    (["name=a"], {}, "give address=HOST:PORT"),
    (["name=a,address=h:1,weight=0"], {}, "weight=0.0 must be > 0"),
    (["name=a,address=h:1,colour=red"], {}, "unknown key(s) colour"),
    (["name=a,address=h:1,topk=two"], {}, "topk='two' is not an integer"),
    (["name=a,address=h:1,kind=topk"], {}, "kind=topk needs topk=K"),
    (["name=a,address=h:1,kind=gold", "name=b,address=h:2"], {"teacher_combine": "mixture"},
     "--teacher-combine mixture mixes distributions over one vocabulary"),
    (["name=a,address=h:1,topk=4,tail=none"], {"teacher_combine": "mixture"}, "leave out tail=none"),
    (["name=a,address=h:1,loss=jsd"], {"teacher_combine": "mixture"}, "the mixture has one, --loss"),
    (["name=a,address=h:1"], {"teacher": "h:3"}, "leave out --teacher and --teacher-outputs"),
    (["name=a,address=h:1"], {"hidden_layers": "1", "hidden_weight": 0.1}, "leave them out"),
    (["name=a,address=h:1"], {"teacher_route": "domain"}, "use all"),
    (["name=a,address=h:1"], {"teacher_route": "field:domain", "teacher_combine": "mixture"},
     "nothing to combine"),
    ([], {"teacher_combine": "mixture", "teacher": "h:1"}, "go with several teachers"),
    (["name=a,store=/s"], {"eval_data": "e"}, "have a store only"),
])
def test_specs_that_cannot_run_are_refused_naming_the_fix(specs, flags, words):
    with pytest.raises(ConfigError) as refused:
        config(*specs, **flags)
    assert words in str(refused.value)


def test_the_command_line_takes_the_flag_once_per_teacher():
    from distill_common.settings import settings_from
    from student_trainer.__main__ import main  # noqa: F401 - the parser is built as the program builds it
    from transformers import HfArgumentParser

    args = HfArgumentParser(TrainConfig).parse_args(
        ["--model", "m", "--data", "d", "--teacher-spec", "name=a,address=h:1", "--teacher-spec", "name=b,address=h:2",
         "--teacher-combine", "mixture"])
    cfg = settings_from(TrainConfig, args)
    assert [p.name for p in cfg.teacher_plans] == ["a", "b"] and cfg.teacher_combine == "mixture"
    assert read_teacher_specs(["name=x,address=h:1"], "") == [TeacherSpec("x", address="h:1")]


# ---- the data's routes -----------------------------------------------------------------------------


def test_each_token_carries_its_examples_teacher_through_packing():
    from distill_demo.tokenizer import train_tokenizer
    from student_trainer.data import BatchIterator, DataError, PackedDataset, tokenize_record

    tokenizer = train_tokenizer(["abc de fgh xyz"] * 4, vocab_size=280)
    records = [{"text": "abc", "domain": "code"}, {"text": "de", "domain": "prose"}, {"text": "fgh", "domain": "code"}]
    packed = PackedDataset.from_records(records, tokenizer, 4, route_field="domain", route_names=["prose", "code"])
    lengths = [len(tokenize_record(r, tokenizer)[0]) for r in records]
    want = [1] * lengths[0] + [0] * lengths[1] + [1] * lengths[2]
    flat = packed.route.reshape(-1).tolist()
    assert flat[:len(want)] == want and set(flat[len(want):]) <= {-1}
    assert packed.fingerprint == PackedDataset.from_records(records, tokenizer, 4).fingerprint
    batch = next(BatchIterator(packed, 2))
    assert batch["route"].shape == batch["input_ids"].shape
    with pytest.raises(DataError, match=r'<records>\[1\]: has \'poetry\' in "domain"'):
        PackedDataset.from_records([records[0], {"text": "x", "domain": "poetry"}], tokenizer, 4,
                                   route_field="domain", route_names=["prose", "code"])
    with pytest.raises(DataError, match='has no field "domain"'):
        PackedDataset.from_records([{"text": "x"}], tokenizer, 4, route_field="domain", route_names=["code"])


# ---- on-policy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("combine", ["sum", "mixture"])
@pytest.mark.parametrize("loss", ["sampled", "divergence"])
def test_on_policy_combines_the_teachers_scores_as_written_out(combine, loss):
    """Sampled tokens: the sampled-token loss against sum_i w_i log p_i (sum) or log sum_i w_i p_i
    (mixture). The divergence on the student's top k: each teacher's at its temperature, weighted
    (sum), or to the mixture, exact on the k ids both scored and the rest."""
    from distill_common.outputs import TeacherOutput
    from student_trainer.losses import sampled_reverse_kl_loss, scored_kd_loss
    from student_trainer.onpolicy import several_teachers_kd
    from student_trainer.teachers import EnsembleOutput

    cfg = TrainConfig(model="m", data="d", kd_weight=0.5, on_policy_fraction=1.0, on_policy_loss=loss,
                      student_topk=4 if loss == "divergence" else 0, teacher_combine=combine, loss="reverse_kl",
                      temperature=1.5, teacher_spec=["name=a,address=h:1,weight=3", "name=b,address=h:2,temperature=2"])
    student = teacher_logits(20, scale=1.0).requires_grad_(True)
    full = {"a": teacher_logits(21), "b": teacher_logits(22)}
    temperatures = {"a": 1.5, "b": 2.0}
    log_p = {name: torch.log_softmax(logits / temperatures[name], -1) for name, logits in full.items()}
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(3))
    score_ids = student.detach().topk(4, dim=-1).indices
    batch = {"input_ids": tokens, "score_ids": torch.cat([score_ids, score_ids[:, :1]], dim=1)}
    mask = torch.ones(B, S, dtype=torch.bool)
    targets = tokens[:, 1:]
    outs = {}
    for name in full:
        pad = torch.zeros(B, 1, V, dtype=torch.float64)
        padded = torch.cat([log_p[name], pad], dim=1)  # the outputs cover S + 1 positions; the loss reads [:, :-1]
        outs[name] = TeacherOutput(0, next_token_logprobs=torch.cat(
            [log_p[name].gather(-1, targets[..., None])[..., 0], pad[..., 0]], dim=1),
            scored_logprobs=padded.gather(-1, batch["score_ids"]))
    ens = EnsembleOutput(0, outs, {"a": None, "b": None})
    got, own = several_teachers_kd(cfg, student, targets, batch, ens, mask, sampled=True)
    weights = {"a": 0.75, "b": 0.25}
    if loss == "sampled":
        at_tokens = {name: lp.gather(-1, targets[..., None])[..., 0] for name, lp in log_p.items()}
        combined = (sum(weights[n] * at_tokens[n] for n in at_tokens) if combine == "sum"
                    else torch.log(sum(weights[n] * at_tokens[n].exp() for n in at_tokens)))
        want = sampled_reverse_kl_loss(student, targets, combined, mask, temperature=cfg.sample_temperature)
    elif combine == "sum":
        want = sum(weights[n] * scored_kd_loss(student, score_ids, outs[n].scored_logprobs[:, :-1], mask,
                                               kind="reverse_kl", temperature=temperatures[n]) for n in outs)
    else:
        known = torch.zeros(B, S, V, dtype=torch.bool).scatter_(-1, score_ids, True)
        want = plain_mixture_loss(student, [(3.0, log_p["a"].exp(), known), (1.0, log_p["b"].exp(), known)], mask,
                                  "reverse_kl", 1.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-9)
    assert torch.allclose(torch.autograd.grad(got, student)[0], torch.autograd.grad(want, student)[0], rtol=1e-7,
                          atol=1e-12)
    assert set(own) == {"a", "b"}
