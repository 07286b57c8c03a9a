"""The client's check that a teacher it joined again serves what the first one did
(student_trainer/joining.py), alone: Join answers built here, no server. Joining again,
resubmitting and the checks' place in them run against real teachers in tests/test_restart.py."""

from __future__ import annotations

import logging

import pytest
import torch

from distill_common import wire
from distill_common.outputs import JoinData, OutputHead
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.quantization import Quantization
from student_trainer.client import TeacherInfo
from student_trainer.errors import Incompatible
from student_trainer.joining import check_same_join_data, check_same_teacher, matched_student_ids

ADDRESS = "teacher:50051"


def answer(*, model_name="tiny-llama", vocab_size=128, hidden_size=32, num_layers=2, backend="gloo",
           output_dtype="float32", quantization=Quantization(), matched=None) -> pb.JoinResponse:
    joined = pb.JoinResponse(
        info=pb.TeacherInfo(model_name=model_name, architecture="LlamaForCausalLM", vocab_size=vocab_size,
                            hidden_size=hidden_size, num_layers=num_layers, dtype="float32",
                            tokenizer_fingerprint="", max_batch_tokens=4096, max_seq_len=256,
                            quantization=quantization.to_info()),
        backend=backend, output_dtype=output_dtype)
    if matched is not None:
        joined.alignment.matched_student_ids.CopyFrom(wire.encode(torch.tensor(matched)))
        joined.alignment.student_vocab_size = 100
    return joined


def check(first: pb.JoinResponse, again: pb.JoinResponse) -> None:
    """check_same_teacher as the client calls it: against what its first Join granted."""
    check_same_teacher(ADDRESS, TeacherInfo.from_proto(first.info), first.backend,
                       wire.parse_output_dtype(first.output_dtype), matched_student_ids(first), again)


def test_the_same_teacher_is_accepted():
    check(answer(), answer())
    check(answer(matched=[3, 1, 4]), answer(matched=[3, 1, 4]))


FP8 = Quantization(format="fp8_e4m3", scaling="row", source="quantized at load")


@pytest.mark.parametrize("changed, named", [
    (dict(vocab_size=256), "vocab_size 128 -> 256"),
    (dict(hidden_size=64), "hidden_size 32 -> 64"),
    (dict(num_layers=4), "num_layers 2 -> 4"),
    (dict(backend="nccl"), "backend gloo -> nccl"),
    (dict(quantization=FP8), f"decoder linears none -> {FP8}"),
    (dict(output_dtype="bfloat16"), "output dtype torch.float32 -> bfloat16"),
])
def test_a_teacher_that_came_back_different_is_refused_naming_what_changed(changed, named):
    with pytest.raises(Incompatible) as raised:
        check(answer(), answer(**changed))
    assert f"the teacher came back different ({named})" in str(raised.value)
    assert "restart the job against it" in str(raised.value)


def test_every_change_is_named():
    with pytest.raises(Incompatible, match=r"\(vocab_size 128 -> 256, backend gloo -> nccl\)"):
        check(answer(), answer(vocab_size=256, backend="nccl"))


@pytest.mark.parametrize("again", [None, [3, 1, 5], [3, 1]])
def test_a_projection_onto_other_student_ids_is_refused(again):
    with pytest.raises(Incompatible, match="the student ids its vocabulary matches"):
        check(answer(matched=[3, 1, 4]), answer(matched=again))


def test_another_model_name_alone_is_only_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="student_trainer.client"):
        check(answer(), answer(model_name="tiny-llama-v2"))
    assert "came back serving tiny-llama-v2 (was tiny-llama)" in caplog.text


def head(weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float = 0.0) -> JoinData:
    return JoinData(head=OutputHead(weight=weight, bias=bias, final_logit_softcapping=softcap))


def test_the_same_output_head_is_accepted_and_a_session_without_one_is_not_checked():
    weight, bias = torch.randn(8, 4), torch.randn(8)
    check_same_join_data(head(weight, bias), head(weight.clone(), bias.clone()))
    check_same_join_data(JoinData(), JoinData())


@pytest.mark.parametrize("again", [
    lambda w, b: JoinData(),  # the head is gone
    lambda w, b: head(w + 1e-3, b),  # other weights
    lambda w, b: head(w, None),  # the bias is gone
    lambda w, b: head(w, b + 1),  # another bias
    lambda w, b: head(w, b, softcap=30.0),  # a softcap now
])
def test_another_output_head_is_refused(again):
    weight, bias = torch.randn(8, 4), torch.randn(8)
    with pytest.raises(Incompatible, match="the teacher came back with another output head"):
        check_same_join_data(head(weight, bias), again(weight, bias))
