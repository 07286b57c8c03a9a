"""The output kinds on their own, no server: asked, checked, laid out, derived, assembled.

Each kind's round trip (teacher derives, student assembles the same tensors) is compared
with values computed straightforwardly from a random forward: the top k by sorting, the
hidden states by the layers asked. The transport is left out (tests/test_session_group.py
sends them over a real group).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from distill_common import wire
from distill_common.outputs import (KINDS, Argmax, AttentionFacts, AttentionInputs, AuxHiddenStates, BatchOutputs,
                                    FinalHidden, ForwardNeeds, HeadFacts, HiddenStates, JoinData, Logits, OutputHead,
                                    NextTokenLogprobs, OutputRequest, OutputSpecError, SubsetLogits, TeacherFacts, TopK,
                                    VocabularyMismatch, default_aux_layers, output_spec)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb

VOCAB, HIDDEN, LAYERS = 50, 12, 4
FACTS = TeacherFacts(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype=torch.float32,
                     tokenizer_fingerprint="abc123")


def _forward(batch: int = 2, seq: int = 5, seed: int = 0) -> BatchOutputs:
    generator = torch.Generator().manual_seed(seed)
    return BatchOutputs(torch.randn(batch, seq, VOCAB, generator=generator),
                        {layer: torch.randn(batch, seq, HIDDEN, generator=generator) for layer in range(LAYERS + 1)})


def _request(*kinds, dtype: str | None = None) -> OutputRequest:
    return OutputRequest.resolve(output_spec(kinds, dtype), FACTS)


def _round_trip(request: OutputRequest, forward: BatchOutputs):
    batch, seq = forward.logits.shape[:2]
    tensors = request.derive(forward, batch=None)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == request.layout(batch, seq)
    assert all(t.is_contiguous() for t in tensors)
    return request.assemble(7, [t.clone() for t in tensors])  # what a student's buffers would hold


# ---- each kind's round trip ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "float16", "bfloat16"])
def test_logits_arrive_whole_in_the_dtype_asked(dtype):
    forward = _forward()
    out = _round_trip(_request(Logits(), dtype=dtype), forward)
    want = forward.logits.to(getattr(torch, dtype) if dtype else torch.float32)
    assert out.batch_id == 7 and out.logits.dtype == want.dtype and torch.equal(out.logits, want)
    assert out.topk_values is None and out.topk_indices is None and out.hidden_states == {}


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("k", [1, 5, VOCAB])
def test_topk_are_the_k_most_likely_ids_and_their_logprobs_under_the_full_softmax(k, temperature):
    forward = _forward()
    out = _round_trip(_request(TopK(k, temperature)), forward)
    assert out.logits is None and out.hidden_states == {}
    assert out.topk_values.shape == out.topk_indices.shape == (2, 5, k)
    assert out.topk_indices.dtype == torch.int32 and out.topk_values.dtype == torch.float32
    logprobs = torch.log_softmax(forward.logits.double() / temperature, dim=-1)
    expected = logprobs.sort(dim=-1, descending=True).values[..., :k]
    torch.testing.assert_close(out.topk_values.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.topk_values.double(), logprobs.gather(-1, out.topk_indices.long()), rtol=0,
                               atol=1e-5)
    # What the student's loss takes as the teacher's tail: the mass of every other id.
    outside = logprobs.exp().scatter(-1, out.topk_indices.long(), 0.0).sum(-1)
    torch.testing.assert_close(1 - out.topk_values.double().exp().sum(-1), outside, rtol=0, atol=1e-5)


def test_topk_values_come_in_the_dtype_asked_ids_in_int32():
    forward = _forward()
    out = _round_trip(_request(TopK(4, 0.5), dtype="bfloat16"), forward)
    want = torch.log_softmax(forward.logits / 0.5, dim=-1).topk(4, dim=-1)
    assert out.topk_values.dtype == torch.bfloat16 and torch.equal(out.topk_values, want.values.bfloat16())
    assert torch.equal(out.topk_indices, want.indices.int())


def test_topk_is_refused_from_a_teacher_that_sends_raw_logits():
    """A teacher older than TeacherInfo.topk_form sends raw logits: the student refuses at join."""
    info = pb.TeacherInfo(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype="float32")
    joined = pb.JoinResponse(info=info, output_dtype="float32")
    with pytest.raises(OutputSpecError, match="TOPK_FORM_UNSPECIFIED, not log-probabilities.*upgrade the teacher"):
        OutputRequest.granted(output_spec([TopK(3)]), joined)
    OutputRequest.granted(output_spec([Logits()]), joined)  # the other kinds do not depend on it
    joined.info.topk_form = pb.TOPK_FORM_LOGPROBS
    assert OutputRequest.granted(output_spec([TopK(3, 2.0)]), joined).kinds == (TopK(3, 2.0),)


def test_topk_shares_the_sessions_logprob_temperature():
    spec = output_spec([TopK(3, 2.0)])
    assert spec.topk == 3 and spec.logprob_temperature == 2.0
    assert TopK.from_spec(pb.OutputSpec(topk=3)) == TopK(3, 1.0)  # 0 on the wire means 1
    with pytest.raises(ValueError, match="a session has one logprob_temperature"):
        output_spec([TopK(3, 2.0), NextTokenLogprobs(1.5)])
    with pytest.raises(OutputSpecError, match="logprob_temperature 0.0001 is too small"):
        OutputRequest.resolve(pb.OutputSpec(topk=3, logprob_temperature=1e-4), FACTS)


def test_hidden_states_are_the_layers_asked_in_the_order_asked():
    forward = _forward()
    layers = (3, 0, LAYERS)
    out = _round_trip(_request(HiddenStates(layers), dtype="float16"), forward)
    assert out.logits is None and out.topk_values is None
    assert list(out.hidden_states) == list(layers)
    for layer in layers:
        assert torch.equal(out.hidden_states[layer], forward.hidden[layer].half())


def test_subset_logits_are_the_columns_of_the_ids_asked_in_the_order_asked():
    forward = _forward()
    ids = (7, 0, VOCAB - 1, 3)
    out = _round_trip(_request(SubsetLogits(ids), dtype="bfloat16"), forward)
    assert out.logits is None and out.subset_logits.shape == (2, 5, len(ids))
    for column, token in enumerate(ids):
        assert torch.equal(out.subset_logits[..., column], forward.logits[..., token].bfloat16())


def test_aux_hidden_states_are_three_layers_side_by_side():
    forward = _forward()
    layers = (3, 1, LAYERS)
    out = _round_trip(_request(AuxHiddenStates(layers)), forward)
    assert out.aux_hidden_states.shape == (2, 5, 3 * HIDDEN) and out.hidden_states == {}
    for i, layer in enumerate(layers):
        assert torch.equal(out.aux_hidden_states[..., i * HIDDEN:(i + 1) * HIDDEN], forward.hidden[layer])


def test_argmax_is_the_greedy_token_over_the_whole_vocabulary():
    forward = _forward()
    out = _round_trip(_request(Argmax(), SubsetLogits((1, 2))), forward)
    assert out.argmax.dtype == torch.int32
    assert torch.equal(out.argmax.long(), forward.logits.argmax(dim=-1))


def test_aux_layers_left_to_the_teacher_are_the_reference_ones_on_both_sides():
    deep = TeacherFacts(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=32, dtype=torch.bfloat16)
    assert default_aux_layers(32) == (2, 16, 29)  # Llama-3-8B: vLLM's and SGLang's (2, L // 2, L - 3)
    spec = output_spec([AuxHiddenStates()])
    assert spec.HasField("aux_hidden_states") and not spec.aux_hidden_states.layers
    teacher_side = OutputRequest.resolve(spec, deep)
    assert teacher_side.kinds == (AuxHiddenStates((2, 16, 29)),)
    assert teacher_side.needs == ForwardNeeds(hidden_layers=frozenset({2, 16, 29}))
    joined = pb.JoinResponse(info=pb.TeacherInfo(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=32,
                                                 dtype="bfloat16", topk_form=TopK.form), output_dtype="bfloat16")
    assert OutputRequest.granted(spec, joined) == teacher_side


def test_a_subset_of_32k_ids_is_hashed_once():
    kind = SubsetLogits(range(32000))
    assert hash(kind) == hash(tuple(range(32000))) and kind == SubsetLogits(tuple(range(32000)))
    assert "_hash" in kind.__dict__  # cached: a request is a dict key for every batch sent
    assert str(kind) == "logit_subset=32000 ids"


def test_every_kind_at_once_in_wire_order():
    forward = _forward()
    # Asked in any order, sent in KINDS order; kinds added later come after the older ones.
    request = _request(Argmax(), HiddenStates((2, 1)), AuxHiddenStates((0, 1, 2)), TopK(3), SubsetLogits((4,)),
                       Logits())
    assert [type(kind) for kind in request] == [Logits, TopK, HiddenStates, SubsetLogits, AuxHiddenStates,
                                                Argmax] == [k for k in KINDS if k in {type(kind) for kind in request}]
    # Every kind has its place in the wire order, once.
    assert len(set(KINDS)) == len(KINDS) == 13
    assert request.layout(2, 5) == [((2, 5, VOCAB), torch.float32), ((2, 5, 3), torch.float32),
                                     ((2, 5, 3), torch.int32), ((2, 2, 5, HIDDEN), torch.float32),
                                     ((2, 5, 1), torch.float32), ((2, 5, 3 * HIDDEN), torch.float32),
                                     ((2, 5), torch.int32)]
    out = _round_trip(request, forward)
    assert torch.equal(out.logits, forward.logits)
    assert torch.equal(out.topk_indices.long(), forward.logits.sort(dim=-1, descending=True).indices[..., :3])
    assert torch.equal(out.hidden_states[2], forward.hidden[2]) and torch.equal(out.hidden_states[1], forward.hidden[1])


def test_layouts_match_what_is_derived_for_every_combination_and_shape():
    choices = [Logits(), TopK(4), HiddenStates((0, 2)), SubsetLogits((5, 1)), AuxHiddenStates((0, 2, 1)), Argmax()]
    for size in range(1, len(choices) + 1):
        for kinds in itertools.combinations(choices, size):
            for dtype in (None, "bfloat16"):
                request = _request(*kinds, dtype=dtype)
                for batch, seq in ((1, 1), (3, 7)):
                    tensors = request.derive(_forward(batch, seq), batch=None)
                    assert [(tuple(t.shape), t.dtype) for t in tensors] == request.layout(batch, seq), (kinds, dtype)


# ---- what the teacher checks at join ----------------------------------------------------


@pytest.mark.parametrize("spec, words", [
    (pb.OutputSpec(), "no outputs requested: ask for logits, topk > 0, hidden layers, final_hidden, attention layers, "
                      "logit_subset, aux_hidden_states, argmax, next_token_logprobs, score_ids > 0, "
                      "cross_tokenizer.span_logprobs, cross_tokenizer.projected or cross_tokenizer.sorted_topk > 0"),
    (pb.OutputSpec(topk=-1), "topk -1 must be between 0 and the vocabulary size 50"),
    (pb.OutputSpec(logits=True, topk=VOCAB + 1), "topk 51 must be between 0 and the vocabulary size 50"),
    (pb.OutputSpec(hidden_layers=[LAYERS + 1]), "hidden layers [5] are out of range: the teacher has 4 layers, "
                                                "so use 0 (embeddings) .. 4"),
    (pb.OutputSpec(hidden_layers=[-1, 2]), "hidden layers [-1] are out of range"),
    (pb.OutputSpec(hidden_layers=[1, 2, 1]), "hidden layers [1, 2, 1] repeat a layer"),
    (pb.OutputSpec(logits=True, dtype="float8"), "outputs.dtype: unknown dtype 'float8'"),
    (pb.OutputSpec(logit_subset=wire.encode(torch.zeros(0, dtype=torch.int32))),
     "outputs.logit_subset is empty: send at least one vocabulary id"),
    (pb.OutputSpec(logit_subset=wire.encode(torch.tensor([4, 9, 4, 1, 9]))),
     "outputs.logit_subset repeats ids [4, 9]: send each id once"),
    (pb.OutputSpec(logit_subset=wire.encode(torch.tensor([1, VOCAB, -2, 3]))),
     "outputs.logit_subset has ids outside the teacher's vocabulary [0, 50): [-2, 50]; keep only ids below 50"),
    (pb.OutputSpec(logit_subset=wire.encode(torch.tensor([[1, 2]]))), "outputs.logit_subset has shape [1, 2]: send "
                                                                       "a 1-D tensor"),
    (pb.OutputSpec(logit_subset=pb.Tensor(dtype="float32", shape=[1], data=b"\0" * 4)),
     "outputs.logit_subset has dtype 'float32'"),
    (pb.OutputSpec(aux_hidden_states=pb.AuxHiddenStates(layers=[1, 2])),
     "aux_hidden_states asks for 2 layers [1, 2]: an EAGLE-3 draft reads exactly 3"),
    (pb.OutputSpec(aux_hidden_states=pb.AuxHiddenStates(layers=[1, 2, LAYERS + 1])),
     "aux_hidden_states layers [5] are out of range: the teacher has 4 layers, so use 0 (embeddings) .. 4"),
    (pb.OutputSpec(aux_hidden_states=pb.AuxHiddenStates(layers=[1, 2, 1])),
     "aux_hidden_states layers [1, 2, 1] repeat a layer"),
    (output_spec([AuxHiddenStates()]), "the default layers (2, L // 2, L - 3) need a teacher of at least 7 layers, "
                                       "this one has 4 (they would be (2, 2, 1)); name three layers in 0 .. 4, "
                                       "e.g. (0, 2, 4)"),
])
def test_requests_the_teacher_cannot_serve_are_refused_saying_what_to_change(spec, words):
    with pytest.raises(OutputSpecError) as refused:
        OutputRequest.resolve(spec, FACTS)
    assert words in str(refused.value)


def test_top_k_is_bounded_by_the_teachers_max_topk():
    bounded = dataclasses.replace(FACTS, max_topk=8)
    assert OutputRequest.resolve(pb.OutputSpec(topk=8), bounded).kinds == (TopK(8),)
    with pytest.raises(OutputSpecError, match="topk 9 exceeds the teacher's --max-topk 8"):
        OutputRequest.resolve(pb.OutputSpec(topk=9), bounded)


def test_the_edges_of_the_ranges_are_served():
    request = OutputRequest.resolve(pb.OutputSpec(topk=VOCAB, hidden_layers=[0, LAYERS]), FACTS)
    assert request.kinds == (TopK(VOCAB), HiddenStates((0, LAYERS))) and request.dtype == torch.float32


def test_logits_need_the_teachers_vocabulary_and_hidden_states_do_not():
    for kinds in ((Logits(),), (TopK(2),), (TopK(2), HiddenStates((1,)))):
        request = _request(*kinds)
        with pytest.raises(VocabularyMismatch, match="has 51 entries, the teacher.s 50: .*same tokenizer"):
            request.check_student(VOCAB + 1, "")
        with pytest.raises(VocabularyMismatch, match="tokenizer differs.*same tokenizer"):
            request.check_student(VOCAB, "another")
        request.check_student(VOCAB, "abc123")
        request.check_student(0, "")  # unknown: not compared
    _request(HiddenStates((1,))).check_student(VOCAB + 1, "another")
    for kinds in ((SubsetLogits((1, 2)),), (Argmax(),), (AuxHiddenStates((0, 1, 2)), Argmax())):
        with pytest.raises(VocabularyMismatch, match="tokenizer differs"):
            _request(*kinds).check_student(VOCAB, "another")
    _request(AuxHiddenStates((0, 1, 2))).check_student(VOCAB + 1, "another")


def test_a_student_asks_each_kind_once_and_only_kinds():
    with pytest.raises(ValueError, match="TopK twice"):
        output_spec([TopK(2), TopK(3)])
    with pytest.raises(TypeError, match="Logits\\(\\), TopK\\(8\\)"):
        output_spec(["logits"])


# ---- the request as a value -------------------------------------------------------------


def test_requests_are_hashable_and_equal_when_equal():
    a, b = _request(Logits(), HiddenStates([1, 2])), _request(HiddenStates((1, 2)), Logits())
    assert a == b and hash(a) == hash(b)
    derived = {a: "tensors"}
    assert derived[b] == "tensors"  # the engine's key: sessions asking the same share one derive
    assert a != _request(Logits(), HiddenStates((2, 1)))  # another order is another wire layout
    assert a != _request(Logits(), HiddenStates((1, 2)), dtype="float16")
    assert _request(TopK(3)) != _request(TopK(4)) and _request(TopK(3)) != _request(Logits(), TopK(3))


def test_the_student_resolves_what_the_teacher_granted():
    spec = output_spec([TopK(3), HiddenStates((1,))])
    info = pb.TeacherInfo(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype="bfloat16",
                          tokenizer_fingerprint="abc123", topk_form=pb.TOPK_FORM_LOGPROBS)
    teacher_side = OutputRequest.resolve(spec, TeacherFacts.from_info(info))
    joined = pb.JoinResponse(info=info, output_dtype="bfloat16")
    assert OutputRequest.granted(spec, joined) == teacher_side and teacher_side.dtype == torch.bfloat16
    # The dtype the join answer names is the one the teacher sends in, whatever the student asked.
    joined.output_dtype = "float16"
    assert OutputRequest.granted(spec, joined).dtype == torch.float16


def test_what_the_forward_must_produce():
    assert _request(Logits(), TopK(2)).needs == ForwardNeeds(logits=True)
    assert not _request(Logits()).needs.hidden_states
    assert not _request(HiddenStates((1,))).needs.logits  # the decoder alone serves it
    needs = ForwardNeeds.union([_request(HiddenStates((1, 3))).needs, _request(Logits(), HiddenStates((3, 0))).needs])
    assert needs == ForwardNeeds(hidden_layers=frozenset({0, 1, 3}), logits=True) and needs.hidden_states


def test_one_batchs_rows_of_a_packed_forward_keep_what_is_needed():
    class Packed:  # the runner's packed forward: logits and every layer's hidden states
        logits = torch.randn(5, 8, VOCAB)
        hidden_states = tuple(torch.randn(5, 8, HIDDEN) for _ in range(LAYERS + 1))

    needs = ForwardNeeds(hidden_layers=frozenset({0, 2}), logits=True)
    rows = BatchOutputs.of_rows(Packed, needs, slice(1, 3), 6)
    assert torch.equal(rows.logits, Packed.logits[1:3, :6]) and sorted(rows.hidden) == [0, 2]
    assert torch.equal(rows.hidden[2], Packed.hidden_states[2][1:3, :6])
    assert rows.covers(needs) and rows.covers(ForwardNeeds())
    assert not rows.covers(ForwardNeeds(hidden_layers=frozenset({1})))


# ---- the final hidden state (and the head, once at join) and attention inputs ------------

WIDTHS = (12, 6, 6)  # q, k, v: 2 heads of 6 for queries, one key/value head
RICH = TeacherFacts(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype=torch.float32,
                    head=HeadFacts(bias=True, final_logit_softcapping=30.0, logit_scale=0.5, unavailable=""),
                    attention=AttentionFacts(*WIDTHS, unavailable=""))


def _rich_forward(batch: int = 2, seq: int = 5, seed: int = 0) -> BatchOutputs:
    generator = torch.Generator().manual_seed(seed)
    return BatchOutputs(None, final_hidden=torch.randn(batch, seq, HIDDEN, generator=generator),
                        attention={layer: tuple(torch.randn(batch, seq, w, generator=generator) for w in WIDTHS)
                                   for layer in range(LAYERS)})


def _rich_request(*kinds, dtype: str | None = None) -> OutputRequest:
    return OutputRequest.resolve(output_spec(kinds, dtype), RICH)


def test_final_hidden_state_arrives_and_the_head_is_sent_once_at_join():
    forward = _rich_forward()
    request = _rich_request(FinalHidden(), dtype="bfloat16")
    assert request.layout(2, 5) == [((2, 5, HIDDEN), torch.bfloat16)]
    tensors = request.derive(forward, batch=None)
    out = request.assemble(3, [t.clone() for t in tensors])
    assert torch.equal(out.final_hidden, forward.final_hidden.bfloat16()) and out.logits is None

    head = OutputHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB), final_logit_softcapping=30.0, logit_scale=0.5)
    assert request.join_layout() == [((VOCAB, HIDDEN), torch.bfloat16), ((VOCAB,), torch.bfloat16)]
    sent = request.join_derive(JoinData(head=head))
    assert [(tuple(t.shape), t.dtype) for t in sent] == request.join_layout()
    received = request.join_assemble([t.clone() for t in sent]).head
    assert torch.equal(received.weight, head.weight.bfloat16()) and torch.equal(received.bias, head.bias.bfloat16())
    assert (received.final_logit_softcapping, received.logit_scale) == (30.0, 0.5)
    # What the student computes from them: softcap(scale * (h W^T + b)).
    h = torch.randn(3, HIDDEN)
    want = 30.0 * torch.tanh(0.5 * (h @ head.weight.T + head.bias) / 30.0)
    assert torch.allclose(head.logits(h), want, atol=1e-5)


def test_kinds_without_join_data_send_nothing_at_join():
    request = _rich_request(Logits(), TopK(2), HiddenStates((1,)), AttentionInputs((0,)))
    assert request.join_layout() == [] and request.join_derive(JoinData()) == []
    assert request.join_assemble([]) == JoinData()
    # A head without bias: the weight alone.
    plain = OutputRequest.resolve(output_spec([FinalHidden()]), FACTS_WITH_PLAIN_HEAD)
    assert plain.join_layout() == [((VOCAB, HIDDEN), torch.float32)]


FACTS_WITH_PLAIN_HEAD = TeacherFacts(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype=torch.float32,
                                     head=HeadFacts(unavailable=""))


def test_attention_inputs_are_the_layers_asked_in_the_order_asked():
    forward = _rich_forward()
    layers = (3, 0)
    request = _rich_request(AttentionInputs(layers))
    assert request.layout(2, 5) == [((2, 2, 5, width), torch.float32) for width in WIDTHS]
    out = _round_trip_rich(request, forward)
    assert list(out.attention_inputs) == list(layers)
    for layer in layers:
        for got, want in zip(out.attention_inputs[layer], forward.attention[layer]):
            assert torch.equal(got, want)


def _round_trip_rich(request: OutputRequest, forward: BatchOutputs):
    batch, seq = forward.final_hidden.shape[:2]
    tensors = request.derive(forward, batch=None)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == request.layout(batch, seq)
    return request.assemble(7, [t.clone() for t in tensors])


def test_the_new_kinds_need_no_logits_and_a_forward_covers_them_only_when_it_kept_them():
    needs = _rich_request(FinalHidden(), AttentionInputs((2, 1))).needs
    assert needs == ForwardNeeds(final_hidden=True, attention_layers=frozenset({1, 2})) and not needs.logits
    kept = BatchOutputs.of_rows(_PackedRich, needs, slice(1, 3), 4)
    assert kept.logits is None and sorted(kept.attention) == [1, 2]
    assert torch.equal(kept.final_hidden, _PackedRich.final_hidden[1:3, :4])
    assert torch.equal(kept.attention[2][1], _PackedRich.attention[2][1][1:3, :4])
    assert kept.covers(needs) and not kept.covers(ForwardNeeds(logits=True))
    assert not kept.covers(ForwardNeeds(attention_layers=frozenset({0})))
    copy = kept.detached()
    assert copy.nbytes == kept.nbytes == (2 * 4 * HIDDEN + 2 * 2 * 4 * sum(WIDTHS)) * 4


class _PackedRich:  # a packed forward of 4 rows: final hidden state and every layer's attention inputs
    logits = None
    hidden_states = None
    final_hidden = torch.randn(4, 6, HIDDEN)
    attention = {layer: tuple(torch.randn(4, 6, w) for w in WIDTHS) for layer in range(LAYERS)}


@pytest.mark.parametrize("facts, kind, words", [
    (RICH, AttentionInputs((LAYERS,)), "attention layers [4] are out of range: the teacher has 4 decoder layers, "
                                       "so use 0 .. 3"),
    (RICH, AttentionInputs((1, 1)), "attention layers [1, 1] repeat a layer"),
    (FACTS, AttentionInputs((0,)), "the teacher cannot send attention inputs: this teacher does not report it"),
    (FACTS, FinalHidden(), "the teacher cannot send its output head to apply on the student: this teacher does not "
                           "report it"),
])
def test_what_the_teacher_cannot_give_is_refused_with_its_reason(facts, kind, words):
    with pytest.raises(OutputSpecError) as refused:
        OutputRequest.resolve(output_spec([kind]), facts)
    assert words in str(refused.value)


def test_the_final_hidden_state_needs_the_teachers_vocabulary_attention_inputs_do_not():
    with pytest.raises(VocabularyMismatch):
        _rich_request(FinalHidden()).check_student(VOCAB + 1, "")
    _rich_request(AttentionInputs((0,))).check_student(VOCAB + 1, "another")


def test_the_student_reads_the_head_and_widths_from_the_join_answer():
    info = pb.TeacherInfo(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype="float32",
                          head=RICH.head.to_info(), attention=RICH.attention.to_info(), topk_form=TopK.form)
    assert TeacherFacts.from_info(info) == RICH
    older = TeacherFacts.from_info(pb.TeacherInfo(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                                                  dtype="float32"))
    assert older.head.unavailable and older.attention.unavailable
    assert older.topk_form == pb.TOPK_FORM_UNSPECIFIED != TopK.form
