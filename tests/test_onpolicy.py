"""On-policy distillation: the teacher's log-probabilities at given tokens, and the trainer's mode.

The output kinds (distill_common/outputs/logprobs.py: NextTokenLogprobs, ScoredLogprobs) alone against
values computed position by position; sampling (student_trainer/onpolicy.py) against decoding
without the cache, and its batches. Then one real server process (a tiny Mistral: another
architecture than the demo's Llama) and real clients over gloo: served values (these kinds' and
TopK's log-probabilities, with its tail) against log_softmax of the same model run here, with
padding, and the top-k loss on what was sent against one written out; bad ids refused
with the field to change; two sessions whose batches share a forward but not their ids to
score; a KD job and an on-policy job on one teacher at once; the trainer's on-policy runs,
which a resume repeats. (The losses: tests/test_onpolicy_losses.py.)
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import requests
import torch

from distill_common import outputs
from distill_common.channel import SESSION_SECRET_KEY
from distill_demo.arithmetic import make_tokenizer, problems, write_jsonl
from distill_common.outputs import (BatchDataError, BatchOutputs, HiddenStates, Logits, NextTokenLogprobs,
                                    OutputRequest, OutputSpecError, ScoredLogprobs, TeacherFacts, TopK, output_spec)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import TeacherClient, onpolicy
from student_trainer.config import TrainConfig
from student_trainer.data import BatchIterator, DataError, PromptDataset, split_prompt
from student_trainer.errors import InvalidRequest
from student_trainer.losses import topk_kd_loss
from teacher_server.launcher import ServerProcess
from teacher_server.sessions import Batch
from tests.helpers import build_tiny_model

VOCAB = 40
FACTS = TeacherFacts(vocab_size=VOCAB, hidden_size=8, num_layers=2, dtype=torch.float32, max_score_ids=6)


def _batch(ids: torch.Tensor, mask: torch.Tensor, score_ids: torch.Tensor | None = None) -> Batch:
    return Batch(0, ids, mask, {"score_ids": score_ids} if score_ids is not None else {})


def _padded(rows: int, seq: int, seed: int, vocab: int = VOCAB):
    """Ids and a mask with right padding in row 0, left padding in row 1, none in the others."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    mask = torch.ones(rows, seq, dtype=torch.int64)
    mask[0, seq - 2:] = 0
    if rows > 1:
        mask[1, :2] = 0
    return ids, mask


def _reference_next(logits, ids, mask, temperature):
    """Position by position: log_softmax(logits[b, t] / T)[ids[b, t + 1]] where t and t + 1 are real, else 0."""
    rows, seq, _ = logits.shape
    want = torch.zeros(rows, seq, dtype=torch.float64)
    for b in range(rows):
        for t in range(seq - 1):
            if mask[b, t] and mask[b, t + 1]:
                want[b, t] = torch.log_softmax(logits[b, t].double() / temperature, dim=-1)[ids[b, t + 1]]
    return want


def _reference_scored(logits, score_ids, mask, temperature):
    rows, seq, k = score_ids.shape
    want = torch.zeros(rows, seq, k, dtype=torch.float64)
    for b in range(rows):
        for t in range(seq):
            if mask[b, t]:
                log_p = torch.log_softmax(logits[b, t].double() / temperature, dim=-1)
                for j in range(k):
                    want[b, t, j] = log_p[score_ids[b, t, j]]
    return want


# ---- the kinds alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_next_token_logprobs_are_the_log_softmax_at_the_next_token(temperature):
    ids, mask = _padded(3, 7, seed=1)
    logits = torch.randn(3, 7, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    request = OutputRequest.resolve(output_spec([NextTokenLogprobs(temperature)], "bfloat16"), FACTS)
    (values,) = request.derive(BatchOutputs(logits), _batch(ids, mask))
    assert values.dtype == torch.float32 and values.shape == (3, 7)  # float32 whatever the dtype asked
    assert request.layout(3, 7) == [((3, 7), torch.float32)]
    torch.testing.assert_close(values.double(), _reference_next(logits, ids, mask, temperature), atol=1e-5, rtol=0)
    assert (values[:, -1] == 0).all() and (values[0, -3:] == 0).all() and (values[1, :2] == 0).all()
    assert (values[2, :-1] < 0).all()
    out = request.assemble(4, [values.clone()])
    assert torch.equal(out.next_token_logprobs, values) and out.logits is None and out.scored_logprobs is None


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_scored_logprobs_are_the_log_softmax_at_the_ids_sent(temperature):
    ids, mask = _padded(2, 6, seed=3)
    logits = (torch.randn(2, 6, VOCAB, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    score_ids = torch.randint(0, VOCAB, (2, 6, 4), generator=torch.Generator().manual_seed(5))
    request = OutputRequest.resolve(output_spec([ScoredLogprobs(4, temperature)]), FACTS)
    (values,) = request.derive(BatchOutputs(logits), _batch(ids, mask, score_ids))
    assert values.dtype == torch.float32 and request.layout(2, 6) == [((2, 6, 4), torch.float32)]
    want = _reference_scored(logits.float(), score_ids, mask, temperature)
    torch.testing.assert_close(values.double(), want, atol=1e-5, rtol=0)
    assert (values[0, -2:] == 0).all() and (values[1, :2] == 0).all()
    assert torch.equal(request.assemble(0, [values]).scored_logprobs, values)


def test_chunks_of_the_vocabulary_pass_give_the_same_values(monkeypatch):
    ids, mask = _padded(3, 9, seed=6)
    logits = torch.randn(3, 9, VOCAB, generator=torch.Generator().manual_seed(7))
    score_ids = torch.randint(0, VOCAB, (3, 9, 5), generator=torch.Generator().manual_seed(8))
    request = OutputRequest.resolve(output_spec([NextTokenLogprobs(), ScoredLogprobs(5)]), FACTS)
    whole = request.derive(BatchOutputs(logits), _batch(ids, mask, score_ids))
    monkeypatch.setattr(outputs.logprobs, "_LOGPROB_CHUNK_BYTES", 4 * VOCAB * 2)  # two rows a chunk
    chunked = request.derive(BatchOutputs(logits), _batch(ids, mask, score_ids))
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_every_kind_at_once_lays_out_what_it_derives():
    request = OutputRequest.resolve(output_spec([ScoredLogprobs(3), Logits(), NextTokenLogprobs(), TopK(2),
                                                 HiddenStates((1,))]), FACTS)
    assert [type(kind) for kind in request][-2:] == [NextTokenLogprobs, ScoredLogprobs]
    ids, mask = _padded(2, 5, seed=9)
    forward = BatchOutputs(torch.randn(2, 5, VOCAB), {1: torch.randn(2, 5, 8)})
    tensors = request.derive(forward, _batch(ids, mask, torch.zeros(2, 5, 3, dtype=torch.int64)))
    assert [(tuple(t.shape), t.dtype) for t in tensors] == request.layout(2, 5)
    assert all(t.is_contiguous() for t in tensors)
    assert request.reads_batch_data and not OutputRequest.resolve(output_spec([NextTokenLogprobs()]),
                                                                  FACTS).reads_batch_data


@pytest.mark.parametrize("spec, words", [
    (pb.OutputSpec(score_ids=7), "score_ids 7 exceeds the teacher's --max-score-ids 6: score fewer ids"),
    (pb.OutputSpec(score_ids=-2), "score_ids -2 must be > 0"),
    (pb.OutputSpec(next_token_logprobs=True, logprob_temperature=-1), "logprob_temperature -1.0 must be positive"),
    (pb.OutputSpec(score_ids=2, logprob_temperature=float("inf")), "logprob_temperature inf must be positive"),
    (pb.OutputSpec(score_ids=2, logprob_temperature=float("nan")), "logprob_temperature nan must be positive"),
    # So small that logits / T overflows float32: the log-probabilities would come out NaN and -inf.
    (pb.OutputSpec(next_token_logprobs=True, logprob_temperature=1e-40), "logprob_temperature 1e-40 .* at least 0.001"),
    (pb.OutputSpec(score_ids=2, logprob_temperature=5e-324), "at least 0.001"),
])
def test_what_the_teacher_cannot_score_is_refused_at_join(spec, words):
    with pytest.raises(OutputSpecError, match=words):
        OutputRequest.resolve(spec, FACTS)


def test_at_the_smallest_temperature_the_log_probabilities_are_finite():
    request = OutputRequest.resolve(output_spec([NextTokenLogprobs(outputs.MIN_LOGPROB_TEMPERATURE),
                                                 ScoredLogprobs(3, outputs.MIN_LOGPROB_TEMPERATURE)]), FACTS)
    ids, mask = _padded(2, 5, seed=4)
    logits = torch.randn(2, 5, VOCAB) * 1e4  # logits far wider apart than any model's
    score_ids = torch.randint(0, VOCAB, (2, 5, 3))
    for values in request.derive(BatchOutputs(logits), _batch(ids, mask, score_ids)):
        assert values.isfinite().all()


@pytest.mark.parametrize("kinds", [(NextTokenLogprobs(0.0),), (NextTokenLogprobs(-0.0),), (ScoredLogprobs(2, 0.0),),
                                   (NextTokenLogprobs(0.0), ScoredLogprobs(2, 0.7)),
                                   (NextTokenLogprobs(float("nan")), ScoredLogprobs(2, 0.7))])
def test_a_temperature_the_teacher_would_not_use_is_refused_on_the_student(kinds):
    """0 on the wire means 1 (proto3's default): a student that asks for 0 would be served at
    T = 1, or at the other kind's temperature, without a word. It is refused before the Join."""
    with pytest.raises(ValueError, match="must be positive and finite"):
        output_spec(kinds)


def test_one_temperature_per_session():
    with pytest.raises(ValueError, match="one logprob_temperature"):
        output_spec([NextTokenLogprobs(0.5), ScoredLogprobs(2, 2.0)])
    spec = output_spec([NextTokenLogprobs(0.5), ScoredLogprobs(2, 0.5)])
    assert OutputRequest.resolve(spec, FACTS).kinds == (NextTokenLogprobs(0.5), ScoredLogprobs(2, 0.5))


def _submit(score_ids: np.ndarray | None, dtype: str = "int32") -> pb.SubmitRequest:
    request = pb.SubmitRequest(input_ids=pb.Tensor(dtype="int64", shape=[2, 3], data=np.zeros(6, "<i8").tobytes()))
    if score_ids is not None:
        request.score_ids.CopyFrom(pb.Tensor(dtype=dtype, shape=list(score_ids.shape),
                                             data=score_ids.astype("<" + np.dtype(dtype).str[1:]).tobytes()))
    return request


@pytest.mark.parametrize("score_ids, dtype, words", [
    (None, "int32", "score_ids is missing: this session asked for score_ids=2"),
    (np.zeros((2, 3, 3)), "int32", r"score_ids has shape \[2, 3, 3\]; it must be \[2, 3, 2\]"),
    (np.zeros((2, 4, 2)), "int32", r"it must be \[2, 3, 2\]: the \[batch, seq\] of input_ids"),
    (np.zeros((2, 3, 2)), "int64", "score_ids has dtype 'int64'; it must be one of \\['int32'\\]"),
    (np.full((2, 3, 2), VOCAB), "int32", r"score_ids must lie in \[0, 40\).*got values in \[40, 40\]"),
    (np.full((2, 3, 2), -1), "int32", r"got values in \[-1, -1\]"),
])
def test_bad_ids_to_score_are_refused_saying_what_to_change(score_ids, dtype, words):
    request = OutputRequest.resolve(output_spec([ScoredLogprobs(2)]), FACTS)
    with pytest.raises(BatchDataError, match=words):
        request.read_batch(_submit(score_ids, dtype), 2, 3)


def test_ids_to_score_that_were_not_asked_for_are_refused():
    request = OutputRequest.resolve(output_spec([NextTokenLogprobs()]), FACTS)
    with pytest.raises(BatchDataError, match="score_ids was sent, but this session did not ask for it"):
        request.read_batch(_submit(np.zeros((2, 3, 2))), 2, 3)
    assert request.read_batch(_submit(None), 2, 3) == {}
    with pytest.raises(ValueError, match="score_ids given, but this session asked for no output that reads it"):
        request.write_batch(pb.SubmitRequest(), 2, 3, score_ids=torch.zeros(2, 3, 2, dtype=torch.int64))


def test_the_student_encodes_what_the_teacher_reads():
    request = OutputRequest.resolve(output_spec([ScoredLogprobs(2)]), FACTS)
    with pytest.raises(ValueError, match="pass score_ids with every batch"):
        request.write_batch(pb.SubmitRequest(), 2, 3)
    with pytest.raises(ValueError, match=r"score_ids has shape \[2, 3\]; it must be \[2, 3, 2\]"):
        request.write_batch(pb.SubmitRequest(), 2, 3, score_ids=torch.zeros(2, 3, dtype=torch.int64))
    # Out of the vocabulary: refused here, not wrapped into it by the cast to int32 (2**32 + 3 is 3).
    for wrapped in (2**32 + 3, -(2**32) + 3, VOCAB):
        score_ids = torch.tensor([wrapped, 0] * 3, dtype=torch.int64).view(2, 3, 1).expand(2, 3, 2)
        with pytest.raises(ValueError, match=rf"must lie in \[0, {VOCAB}\).*\[{min(wrapped, 0)}, {max(wrapped, 0)}\]"):
            request.write_batch(pb.SubmitRequest(), 2, 3, score_ids=score_ids)
    message = pb.SubmitRequest()
    ids = torch.randint(0, VOCAB, (2, 3, 2))
    request.write_batch(message, 2, 3, score_ids=ids)
    assert torch.equal(request.read_batch(message, 2, 3)["score_ids"], ids)


# ---- sampling and on-policy batches ---------------------------------------------------------------

ARITHMETIC = make_tokenizer()


def _tiny_student(vocab: int = len(ARITHMETIC), seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).double().eval()


def _greedy_without_cache(model, prompt: torch.Tensor, max_new_tokens: int, stops: set[int], topk: int):
    """Token by token, the whole sequence each time, one prompt alone."""
    ids, ranked = prompt.clone(), []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids[None]).logits[0, -1]
        ranked.append(logits.topk(topk).indices)
        ids = torch.cat([ids, logits.argmax()[None]])
        if int(ids[-1]) in stops:
            break
    return ids[len(prompt):], torch.stack(ranked)


def test_batched_sampling_with_the_cache_equals_decoding_each_prompt_without_it():
    model = _tiny_student()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, len(ARITHMETIC), (length,), generator=generator) for length in (3, 7, 5)]
    first = int(_greedy_without_cache(model, prompts[1], 1, set(), 1)[0][0])
    for stops in ({1}, {1, first}):  # the second stops prompt 1 at its first token, the others later or never
        completions, ranked = onpolicy.sample(model, prompts, max_new_tokens=6, temperature=0.0, top_p=1.0,
                                              stop_ids=sorted(stops), pad_id=0, topk=3)
        for prompt, completion, ranks in zip(prompts, completions, ranked):
            want, want_ranks = _greedy_without_cache(model, prompt, 6, stops, 3)
            assert torch.equal(completion, want) and torch.equal(ranks, want_ranks)
        assert len(completions[1]) == (1 if first in stops else len(completions[1]))
    assert model.training is False


def test_top_p_samples_only_the_smallest_set_holding_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    generator = torch.Generator().manual_seed(1)
    for top_p, allowed in ((0.7, {0, 1}), (0.85, {0, 1, 2}), (0.4, {0}), (1.0, {0, 1, 2, 3})):
        picked = onpolicy._pick(logits, 1.0, top_p, generator)
        assert set(picked.tolist()) == allowed, top_p
    # Renormalised over the set: 0.5 / 0.8 of the picks are token 0 at top_p 0.7.
    share = (onpolicy._pick(logits, 1.0, 0.7, generator) == 0).float().mean()
    assert abs(share - 0.625) < 0.03


def _prompts(tmp_path, count: int = 16, shape: str = "prompt_completion"):
    return write_jsonl(tmp_path / f"{shape}.jsonl", problems(count, seed=0, digits=2), shape=shape)


def _source(tmp_path, model, rank: int = 0, **settings) -> onpolicy.OnPolicyBatches:
    cfg = TrainConfig(model="student", data="data", teacher="host:1", seq_len=16, batch_size=4, seed=0,
                      **{"on_policy_fraction": 1.0, "on_policy_loss": "divergence", "max_new_tokens": 4,
                         "student_topk": 3, **settings})
    prompts = BatchIterator(PromptDataset(_prompts(tmp_path), ARITHMETIC, 16, min_new_tokens=4), 4, seed=0)
    return onpolicy.OnPolicyBatches(prompts, model, cfg, stop_ids=[1], pad_id=0, rank=rank)


def test_a_sampled_batch_is_prompt_then_completion_with_the_students_top_k(tmp_path):
    model = _tiny_student()
    batch = next(_source(tmp_path, model))
    assert batch["on_policy"] is True
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    records = problems(16, seed=0, digits=2)
    order = BatchIterator(PromptDataset(_prompts(tmp_path), ARITHMETIC, 16, min_new_tokens=4), 4, seed=0)
    for row, index in enumerate(order.batch_indices(0, 0).tolist()):
        prompt = ARITHMETIC(records[index][0])["input_ids"]
        start, end = len(prompt), int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :start].tolist() == prompt
        width = batch["input_ids"].shape[1]
        assert batch["loss_mask"][row].tolist() == [0] * start + [1] * (end - start) + [0] * (width - end)
        completion = batch["input_ids"][row, start:end].tolist()
        assert (completion[-1] == 1 or len(completion) == 4) and 1 not in completion[:-1]  # ends at eos or at 4
        positions = range(start - 1, end - 1)  # each ranks the candidates for the next token
        assert torch.equal(batch["score_ids"][row, positions], logits[row, positions].topk(3).indices)


def test_ranks_sample_independently_and_a_resume_samples_the_same(tmp_path):
    model = _tiny_student()
    rank0, rank1 = _source(tmp_path, model, rank=0), _source(tmp_path, model, rank=1)
    a0, a1 = next(rank0), next(rank1)
    assert torch.equal(a0["input_ids"][:, :6], a1["input_ids"][:, :6])  # the same prompts (world size 1 here)
    assert not torch.equal(a0["input_ids"], a1["input_ids"])  # sampled differently
    state = rank0.state_dict()
    b = next(rank0)
    resumed = _source(tmp_path, model, rank=0)
    resumed.load_state_dict(state)
    again = next(resumed)
    assert all(torch.equal(b[key], again[key]) for key in ("input_ids", "attention_mask", "loss_mask", "score_ids"))


def test_reference_batches_keep_the_datas_completions(tmp_path):
    model = _tiny_student()
    batch = next(_source(tmp_path, model, on_policy_fraction=0.0))
    assert batch["on_policy"] is False and batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(batch["score_ids"], logits.topk(3).indices)


def test_prompts_from_both_record_shapes_are_the_same_problem(tmp_path):
    ids, mask, start = split_prompt({"prompt": "57+68=", "completion": "125"}, ARITHMETIC)
    chat_ids, chat_mask, chat_start = split_prompt(
        {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                      {"role": "user", "content": "57+68="}, {"role": "assistant", "content": "125"}]}, ARITHMETIC)
    assert ids[start:] == chat_ids[chat_start:] == ARITHMETIC("125")["input_ids"] + [1]
    assert mask[start:] == chat_mask[chat_start:] == [1, 1, 1, 1] and not any(chat_mask[:chat_start])
    assert ARITHMETIC.decode(chat_ids[:chat_start]) == "<user>1+1=<assistant>2<eos><user>57+68=<assistant>"
    with pytest.raises(DataError, match="have no prompt"):
        split_prompt({"text": "1+1=2"}, ARITHMETIC)
    with pytest.raises(DataError, match="no assistant message"):
        split_prompt({"messages": [{"role": "user", "content": "1+1="}]}, ARITHMETIC)
    with pytest.raises(DataError, match=r"leaves fewer than 4 of --seq-len 8 to generate: raise --seq-len"):
        PromptDataset(_prompts(tmp_path), ARITHMETIC, 8, min_new_tokens=4)


@pytest.mark.parametrize("settings, words", [
    (dict(on_policy_fraction=1.5), "--on-policy-fraction 1.5 must lie in"),
    (dict(on_policy_fraction=0.5, kd_weight=0.0), "needs the teacher: --kd-weight > 0"),
    (dict(on_policy_fraction=1.0, topk=8), "leave out --hidden-layers and --topk"),
    (dict(student_topk=4), "--student-topk applies to on-policy training"),
    (dict(on_policy_fraction=1.0, student_topk=4), "no batch uses with --on-policy-fraction 1 --on-policy-loss"),
    (dict(on_policy_fraction=1.0, sample_temperature=0.0), "--sample-temperature 0.0 must be > 0"),
    (dict(on_policy_fraction=1.0, top_p=0.0), "--top-p 0.0 must lie in"),
    (dict(on_policy_fraction=1.0, max_new_tokens=512), "--max-new-tokens 512 must be >= 1 and leave room"),
])
def test_on_policy_settings_that_cannot_work_name_the_flag(settings, words):
    from distill_common.settings import ConfigError

    with pytest.raises(ConfigError, match=words):
        TrainConfig(model="student", data="data", teacher="host:1", seq_len=512, **settings)


# ---- a real server and real clients -------------------------------------------------------------

SERVED_VOCAB = 384
MAX_IDS = 8
MAX_BATCH_TOKENS = 512
MAX_SEQ = 48
# The largest batch's full logits and top 5 (values, int32 ids) in float32: what the KD job below asks, exactly.
MAX_OUTPUT_BYTES = MAX_BATCH_TOKENS * (4 * SERVED_VOCAB + 2 * 4 * 5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=SERVED_VOCAB,
                            architecture="mistral")


@pytest.fixture(scope="module")
def local(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_dir):
    # --max-seq-len does not divide --max-batch-tokens: the budget holds for batches of all 512 tokens
    # all the same (16 x 32), not only for the 480 of ten sequences of 48.
    server = ServerProcess("--model", str(model_dir), "--max-batch-tokens", str(MAX_BATCH_TOKENS), "--max-seq-len",
                           str(MAX_SEQ), "--max-score-ids", str(MAX_IDS), "--max-output-bytes", str(MAX_OUTPUT_BYTES))
    yield server
    assert server.stop() == 0, server.log


def _local_logits(local, ids, mask):
    with torch.no_grad():
        return local(input_ids=ids, attention_mask=mask).logits


def test_served_logprobs_equal_the_local_teachers_with_padding(server, local):
    generator = torch.Generator().manual_seed(21)
    batches = []
    for rows, seq in ((3, 17), (2, 9), (4, 30)):  # several shapes in flight: packed, right-padded
        ids, mask = _padded(rows, seq, seed=int(torch.randint(0, 1000, (1,), generator=generator)),
                            vocab=SERVED_VOCAB)
        batches.append((ids, mask, torch.randint(0, SERVED_VOCAB, (rows, seq, 5), generator=generator)))
    kinds = (NextTokenLogprobs(0.8), ScoredLogprobs(5, 0.8))
    with TeacherClient(server.address, "cpu", outputs=kinds, max_inflight=3) as teacher:
        futures = [teacher.submit(ids, mask, score_ids=score) for ids, mask, score in batches]
        results = [future.result(timeout=120) for future in futures]
    for (ids, mask, score_ids), out in zip(batches, results):
        logits = _local_logits(local, ids, mask)
        log_p = torch.log_softmax(logits / 0.8, dim=-1)
        real = mask.bool()
        keep = real[:, :-1] & real[:, 1:]
        assert out.next_token_logprobs.dtype == out.scored_logprobs.dtype == torch.float32
        nxt = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        assert (out.next_token_logprobs[:, :-1][keep] - nxt[keep]).abs().max() <= 1e-5
        assert (out.next_token_logprobs[:, :-1][~keep] == 0).all() and (out.next_token_logprobs[:, -1] == 0).all()
        scored = log_p.gather(-1, score_ids)
        assert (out.scored_logprobs[real] - scored[real]).abs().max() <= 1e-5
        assert (out.scored_logprobs[~real] == 0).all()


def test_served_topk_are_the_local_models_logprobs_and_the_tail_is_the_rest(server, local):
    k, temperature = 5, 1.7
    ids, mask = _padded(3, 13, seed=5, vocab=SERVED_VOCAB)
    with TeacherClient(server.address, "cpu", outputs=(TopK(k, temperature),)) as teacher:
        assert teacher.outputs.teacher.topk_form == TopK.form  # the join answer said so
        out = teacher.submit(ids, mask).result(timeout=120)
    assert type(local).__name__ == "MistralForCausalLM"
    log_p = torch.log_softmax(_local_logits(local, ids, mask).double() / temperature, dim=-1)
    real = mask.bool()
    assert out.topk_values.shape == out.topk_indices.shape == (3, 13, k) and out.topk_indices.dtype == torch.int32
    # The k largest (near-ties may swap ids, not values), each the log-probability of its id.
    largest = log_p.sort(dim=-1, descending=True).values[..., :k]
    assert (out.topk_values.double() - largest)[real].abs().max() <= 1e-5
    top = out.topk_indices.long()
    assert (out.topk_values.double() - log_p.gather(-1, top))[real].abs().max() <= 1e-5
    tail = 1 - out.topk_values.double().exp().sum(-1)
    rest = log_p.exp().scatter(-1, top, 0.0).sum(-1)
    assert (tail - rest)[real].abs().max() <= 1e-5 and tail[real].min() > 0.5  # a random model's tail is heavy

    # The loss on what was sent, the temperature applied once (on the teacher), against the
    # k + 1 buckets of the local teacher's softmax and the student's, written out.
    student = torch.randn(3, 13, SERVED_VOCAB, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    loss = topk_kd_loss(student.float(), out.topk_values, out.topk_indices, real, temperature=temperature)
    p, q = log_p.exp(), torch.softmax(student / temperature, dim=-1)
    p_buckets = torch.cat([p.gather(-1, top), 1 - p.gather(-1, top).sum(-1, keepdim=True)], -1)
    q_buckets = torch.cat([q.gather(-1, top), 1 - q.gather(-1, top).sum(-1, keepdim=True)], -1)
    per_token = (p_buckets * (p_buckets.log() - q_buckets.log())).sum(-1)
    assert loss.item() == pytest.approx(temperature**2 * per_token[real].mean().item(), rel=1e-5)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TeacherServiceStub(channel)


def _raw_join(stub, **outputs_fields) -> pb.JoinResponse:
    peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
    return stub.Join(pb.JoinRequest(outputs=pb.OutputSpec(**outputs_fields), peer=peer), timeout=10)


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_ids_are_refused_by_the_server(server, stub):
    code, message = _refusal(lambda: _raw_join(stub, score_ids=MAX_IDS + 1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"--max-score-ids {MAX_IDS}" in message
    # A session whose group never forms still has its Submits validated (tests/test_bad_input.py).
    joined = _raw_join(stub, score_ids=3)
    secret = ((SESSION_SECRET_KEY, joined.session_secret),)
    ids = np.zeros((2, 4), "<i8")
    cases = [(np.zeros((2, 4, 2), "<i4"), r"must be [2, 4, 3]"),
             (np.full((2, 4, 3), SERVED_VOCAB, "<i4"), f"must lie in [0, {SERVED_VOCAB})"),
             (None, "score_ids is missing")]
    for batch_id, (score_ids, words) in enumerate(cases):
        request = pb.SubmitRequest(session_id=joined.session_id, batch_id=batch_id,
                                   input_ids=pb.Tensor(dtype="int64", shape=[2, 4], data=ids.tobytes()))
        if score_ids is not None:
            request.score_ids.CopyFrom(pb.Tensor(dtype="int32", shape=list(score_ids.shape), data=score_ids.tobytes()))
        code, message = _refusal(lambda: stub.Submit(request, timeout=10, metadata=secret))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in message, message
    # Through the client: the refusal reaches the future as InvalidRequest; the session serves on.
    with TeacherClient(server.address, "cpu", outputs=(NextTokenLogprobs(),)) as teacher:
        bad = teacher.submit(torch.tensor([[1, 2, SERVED_VOCAB, 3]]))
        with pytest.raises(InvalidRequest, match="token ids must lie in"):
            bad.result(timeout=60)
        assert teacher.submit(torch.tensor([[1, 2, 3, 4]])).result(timeout=60).next_token_logprobs.shape == (1, 4)


def test_log_probabilities_count_in_the_output_bytes_budget(stub):
    """The budget holds full logits and top 5 exactly; 4 bytes a token more for the next token's
    log-probability, or 4 per scored id, go over it: refused at join, naming the flag."""
    assert stub.GetInfo(pb.GetInfoRequest(), timeout=10).dtype == "float32"  # the budget's arithmetic assumes it
    _raw_join(stub, logits=True, topk=5)  # fits exactly
    for extra in (dict(next_token_logprobs=True), dict(score_ids=1)):
        code, message = _refusal(lambda: _raw_join(stub, logits=True, topk=5, **extra))
        need = MAX_OUTPUT_BYTES + 4 * MAX_BATCH_TOKENS
        assert code == grpc.StatusCode.FAILED_PRECONDITION, message
        assert f"{need} bytes" in message and f"{MAX_OUTPUT_BYTES} bytes" in message and "--max-output-bytes" in message
    _raw_join(stub, next_token_logprobs=True, score_ids=MAX_IDS)  # small beside logits


def test_sessions_sharing_a_forward_get_the_values_of_their_own_ids(server, local):
    """Same tokens, different ids to score, in the same forwards: each gets its own values.

    Both clients submit bursts of one batch while the other does too, so the engine plans them
    into one forward (its twin sharing, counted as shared_in_forward, is checked to happen)."""
    ids = torch.randint(0, SERVED_VOCAB, (2, 12), generator=torch.Generator().manual_seed(31))
    mask = torch.ones_like(ids)
    log_p = torch.log_softmax(_local_logits(local, ids, mask), dim=-1)
    shared_before = requests.get(f"{server.http}/v1/status", timeout=10).json()["cache"]["shared_in_forward"]
    errors: list[str] = []
    go = threading.Barrier(2, timeout=60)

    def student(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with TeacherClient(server.address, "cpu", outputs=(ScoredLogprobs(4),), max_inflight=6,
                           job_id=f"scorer-{seed}") as teacher:
            go.wait()
            for _ in range(3):
                sent = [torch.randint(0, SERVED_VOCAB, (2, 12, 4), generator=generator) for _ in range(6)]
                futures = [teacher.submit(ids, mask, score_ids=score) for score in sent]
                for score, future in zip(sent, futures):
                    diff = (future.result(timeout=120).scored_logprobs - log_p.gather(-1, score)).abs().max()
                    if diff > 1e-5:
                        errors.append(f"student {seed}: off by {diff:.3g}")

    threads = [threading.Thread(target=student, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    shared = requests.get(f"{server.http}/v1/status", timeout=10).json()["cache"]["shared_in_forward"]
    assert shared > shared_before, "no two batches shared a forward: the test did not exercise sharing"


def test_a_kd_job_and_an_on_policy_job_share_the_teacher_at_once(server, local):
    """A KD job (full logits, top k) and an on-policy one (next-token and scored log-probabilities),
    submitting at the same time: each receives its own outputs, exact."""
    errors: list[str] = []
    go = threading.Barrier(2, timeout=60)

    def job(name: str, kinds, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with TeacherClient(server.address, "cpu", outputs=kinds, max_inflight=3, job_id=name) as teacher:
            go.wait()
            sent = []
            for _ in range(5):
                ids, mask = _padded(2, int(torch.randint(6, 20, (1,), generator=generator)), seed=seed + len(sent),
                                    vocab=SERVED_VOCAB)
                score = torch.randint(0, SERVED_VOCAB, (*ids.shape, 4), generator=generator)
                extra = {"score_ids": score} if name == "on-policy" else {}
                sent.append((ids, mask, score, teacher.submit(ids, mask, **extra)))
            for ids, mask, score, future in sent:
                out = future.result(timeout=120)
                logits = _local_logits(local, ids, mask)
                real = mask.bool()
                if name == "kd":
                    diffs = [(out.logits - logits)[real].abs().max(),
                             (out.topk_values - torch.log_softmax(logits, -1).topk(5).values)[real].abs().max()]
                else:
                    log_p = torch.log_softmax(logits, -1)
                    keep = real[:, :-1] & real[:, 1:]
                    nxt = log_p[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
                    diffs = [(out.next_token_logprobs[:, :-1] - nxt)[keep].abs().max(),
                             (out.scored_logprobs - log_p.gather(-1, score))[real].abs().max()]
                if max(diffs) > 1e-5:
                    errors.append(f"{name}: off by {max(diffs):.3g}")

    threads = [threading.Thread(target=job, args=("kd", (Logits(), TopK(5)), 1)),
               threading.Thread(target=job, args=("on-policy", (NextTokenLogprobs(), ScoredLogprobs(4)), 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors


# ---- the trainer's on-policy mode --------------------------------------------------------------------


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    """A student of the teacher's vocabulary width that reads arithmetic with one token per character."""
    path = build_tiny_model(tmp_path_factory.mktemp("student") / "model", vocab_size=SERVED_VOCAB, layers=1,
                            hidden_size=16, seed=3)
    make_tokenizer(path)
    return path


def _train(server, student_dir, data, output_dir, **settings) -> list[dict]:
    from student_trainer.train import train

    cfg = TrainConfig(model=str(student_dir), data=str(data), teacher=server.address, output_dir=str(output_dir),
                      seq_len=16, batch_size=4, max_new_tokens=4, lr=5e-2, seed=3, prefetch=1, sample_temperature=2.0,
                      **{"on_policy_fraction": 0.5, "student_topk": 3, "max_steps": 6, "save_every": 3, **settings})
    return train(cfg)["history"]


def test_an_on_policy_run_resumed_repeats_the_uninterrupted_one(server, student_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", problems(40, seed=1, digits=2))
    whole = _train(server, student_dir, data, tmp_path / "a")
    assert {record["on_policy"] for record in whole} == {0.0, 1.0}  # sampled and reference batches both ran
    assert all(np.isfinite(record["loss"]) for record in whole)
    first = _train(server, student_dir, data, tmp_path / "b", stop_after_steps=3)
    second = _train(server, student_dir, data, tmp_path / "b", resume=True)
    assert [record["step"] for record in first + second] == list(range(1, 7))
    for want, got in zip(whole, first + second):
        for key in ("loss", "kd", "on_policy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (key, want, got)
