"""One batch fails alone: a real teacher process serving a GPT-2-shaped model (learned positions,
64 of them) loaded the way any model with its own code is (`auto_map`, --trust-remote-code),
whose forward misbehaves on marked tokens; students in this process and the trainer's CLI in a
child, over gloo.

- RAISE: the forward raises, as a model does on an input it cannot run.
- SKEW: the forward runs, but one layer's hidden states come out a position short: deriving
  a session's hidden states from them fails (the teacher's outputs step, not its forward).
- SLOW: the forward sleeps first, so that batches submitted meanwhile queue up and are packed
  into the next forward together.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import grpc
import pytest
import requests
import torch

from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc
from student_trainer import (Argmax, AuxHiddenStates, FinalHidden, HiddenStates, Logits, SubsetLogits, TeacherClient,
                             TopK)
from student_trainer.errors import BatchFailed, Incompatible, InvalidRequest
from teacher_server.launcher import ServerProcess, child_env, metrics_samples
from tests.helpers import ROOT, wait_until

VOCAB = 96
RAISE, SLOW, SKEW = VOCAB - 1, VOCAB - 2, VOCAB - 3
POSITIONS = 64  # GPT-2's n_positions: a table of learned positions, one row each
SLOW_S = 1.5
MAX_BATCH_TOKENS = 256
# Logits and two hidden layers of a 4 x 64 batch fit (163,840 bytes in float32); three do not.
MAX_OUTPUT_BYTES = 180_000
MAX_TOPK = 16
JOIN_TIMEOUT_S = 12.0
# How long a batch the teacher cannot serve may take to fail at the student: the teacher tells
# it on the submit stream once the failed pack was run again batch by batch (a SLOW forward
# first), with room for a loaded machine. No session ends and nothing is sent again.
FAILS_WITHIN_S = 15.0

FAULTY_MODEL = '''"""A GPT-2 that misbehaves on marked tokens (tests/test_isolation.py)."""
import time

from transformers import GPT2LMHeadModel


class FaultyGPT2LMHeadModel(GPT2LMHeadModel):
    def forward(self, input_ids=None, **kwargs):
        config = self.config

        def marked(token):
            return input_ids is not None and bool((input_ids == token).any())

        if marked(config.raise_token_id):
            raise RuntimeError(f"this model cannot run token {config.raise_token_id} (a marked input)")
        if marked(config.slow_token_id):
            time.sleep(config.slow_s)
        out = super().forward(input_ids=input_ids, **kwargs)
        if marked(config.skew_token_id) and out.hidden_states is not None:
            hidden = list(out.hidden_states)
            hidden[1] = hidden[1][:, :-1]
            out.hidden_states = tuple(hidden)
        return out
'''


def build_gpt2(path, **config):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2,
                               bos_token_id=0, eos_token_id=0, **config)).save_pretrained(path)
    return path


def word_tokenizer():
    """Words w0 .. w92 and the three marks, one id each: the data says which ids the teacher sees."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 3)} | {"RAISE": RAISE, "SLOW": SLOW, "SKEW": SKEW}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w0", unk_token="w1")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = build_gpt2(tmp_path_factory.mktemp("teacher") / "faulty-gpt2", raise_token_id=RAISE, slow_token_id=SLOW,
                      skew_token_id=SKEW, slow_s=SLOW_S)
    (path / "modeling_faulty.py").write_text(FAULTY_MODEL)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_faulty.FaultyGPT2LMHeadModel"}
    (path / "config.json").write_text(json.dumps(config))
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(teacher_dir, tmp_path_factory):
    # transformers copies the model's code to its modules cache: one of the test's own.
    env = child_env(HF_MODULES_CACHE=str(tmp_path_factory.mktemp("hf-modules")))
    server = ServerProcess("--model", str(teacher_dir), "--trust-remote-code", "--max-batch-tokens",
                           str(MAX_BATCH_TOKENS), "--max-topk", str(MAX_TOPK), "--max-output-bytes",
                           str(MAX_OUTPUT_BYTES), "--heartbeat-interval-s", "0.5", "--lease-s", "10",
                           "--join-timeout-s", str(JOIN_TIMEOUT_S), env=env)
    # A session that never forms its group, joined now: the teacher ends it after the join
    # timeout, while the other tests run, and then says why (test_an_ended_session_says_why, last).
    with grpc.insecure_channel(server.address) as channel:
        server.unformed = pb_grpc.TeacherServiceStub(channel).Join(pb.JoinRequest(
            job_id="never-forms", outputs=pb.OutputSpec(logits=True),
            peer=pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)), timeout=30)
    yield server
    assert server.stop() == 0, server.log[-3000:]


@pytest.fixture(scope="module")
def reference(teacher_dir):
    """The same weights as a plain GPT-2 (no auto_map code), which misbehaves on nothing."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(teacher_dir).eval()


def ids(*marks: int, seq: int = 8, seed: int = 0) -> torch.Tensor:
    batch = torch.randint(1, VOCAB - 3, (1, seq), generator=torch.Generator().manual_seed(seed))
    for i, mark in enumerate(marks):
        batch[0, i + 1] = mark
    return batch


def client(server, *outputs, **options) -> TeacherClient:
    return TeacherClient(server.address, "cpu", outputs=outputs or (Logits(),), join_timeout_s=JOIN_TIMEOUT_S,
                         **options)


def healthy(server) -> None:
    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200, server.log[-3000:]


def failed_batches(server) -> float:
    return metrics_samples(server.http).get(("teacher_batches_failed_total", ()), 0.0)


def test_a_gpt2_shaped_teacher_takes_its_position_limit_and_refuses_a_longer_batch_at_submit(server, reference):
    with client(server) as student:
        assert student.info.max_seq_len == POSITIONS  # not 8192: GPT-2 has no row for position 64
        with pytest.raises(InvalidRequest) as refused:
            student.submit(ids(seq=POSITIONS + 8)).result(timeout=30)
        message = str(refused.value)
        assert f"sequence length {POSITIONS + 8}" in message and f"--max-seq-len {POSITIONS}" in message
        assert "wpe" in message  # what sets the limit
        out = student.submit(ids(seq=POSITIONS)).result(timeout=30)  # the longest it can run
        with torch.no_grad():
            assert torch.allclose(out.logits, reference(ids(seq=POSITIONS)).logits, atol=1e-4)
    healthy(server)


def test_outputs_over_the_teachers_limits_are_refused_at_join_naming_the_flag(server):
    with pytest.raises(InvalidRequest, match=f"topk {MAX_TOPK + 1} exceeds the teacher's --max-topk {MAX_TOPK}"):
        client(server, TopK(MAX_TOPK + 1))
    with pytest.raises(Incompatible) as refused:
        client(server, Logits(), HiddenStates((0, 1, 2)))
    message = str(refused.value)
    # 4 x 64 tokens x (96 logits + 3 x 32 hidden) x 4 bytes
    assert "196608 bytes" in message and f"{MAX_OUTPUT_BYTES} bytes" in message and "--max-output-bytes" in message
    assert "4 x 64" in message
    # The output head, sent once at join, counts too: 4 x 64 tokens x (96 logits + 4 x 2 top-k + 32 hidden
    # + 32 final hidden) x 4 bytes = 172032 per batch, under the limit; 96 x 32 x 4 = 12288 more at join.
    with pytest.raises(Incompatible) as refused:
        client(server, Logits(), TopK(4), HiddenStates((0,)), FinalHidden())
    message = str(refused.value)
    assert "184320 bytes" in message and "(12288 bytes) of it sent once at join" in message


def test_the_draft_kinds_count_in_the_output_bytes_budget(server):
    # A subset of every id, three layers and the argmax: 4 x 64 tokens x ((96 + 3 x 32) x 4 + 4) bytes.
    with pytest.raises(Incompatible) as refused:
        client(server, SubsetLogits(range(VOCAB)), AuxHiddenStates((0, 1, 2)), Argmax())
    message = str(refused.value)
    assert "197632 bytes" in message and "logit_subset=96 ids" in message and "aux_hidden_states=(0, 1, 2)" in message
    assert "a smaller logit subset" in message
    # 40 ids fit (4 x 64 x ((40 + 96) x 4 + 4) = 140,288 bytes) and are served.
    subset = tuple(range(0, 80, 2))
    with client(server, SubsetLogits(subset), AuxHiddenStates((0, 1, 2)), Argmax()) as student:
        out = student.submit(ids(seed=5)).result(timeout=60)
    assert out.subset_logits.shape == (1, 8, len(subset)) and out.aux_hidden_states.shape == (1, 8, 96)


def _packed_with_a_bystander(server, victim_outputs, mark: int):
    """The bystander keeps the engine in a SLOW forward while the victim's marked batch and the
    bystander's next batch queue; the next forward packs both. Returns (victim's error,
    bystander's outputs, the bystander's session ids before and after, the victim's time to fail)."""
    with client(server, Logits(), job_id="bystander") as bystander, \
            client(server, *victim_outputs, job_id="victim", max_resubmits=1) as victim:
        before = bystander.session_id
        gate = bystander.submit(ids(SLOW, seed=1))
        time.sleep(0.5)  # the teacher is inside the SLOW forward
        started = time.monotonic()
        doomed = victim.submit(ids(mark, seed=2))
        served = bystander.submit(ids(seed=3))
        output = served.result(timeout=60)
        gate.result(timeout=60)
        with pytest.raises(BatchFailed) as failed:
            doomed.result(timeout=FAILS_WITHIN_S)
        took_s = time.monotonic() - started
        assert victim.reconnects == 0  # the failed batch ended no session of the victim either
        # The bystander goes on being served, on the session it had.
        again = bystander.submit(ids(seed=4)).result(timeout=60)
        assert again.logits.shape == (1, 8, VOCAB)
        return failed.value, output, (before, bystander.session_id, bystander.reconnects), took_s


def test_a_forward_that_fails_is_run_batch_by_batch_so_only_the_batch_that_cannot_run_fails(server, reference):
    failed_before = failed_batches(server)
    error, output, (before, after, reconnects), took_s = _packed_with_a_bystander(server, (Logits(),), RAISE)
    assert f"this model cannot run token {RAISE}" in str(error)  # the teacher's reason, at the student
    assert took_s < FAILS_WITHIN_S
    assert after == before and reconnects == 0  # no rejoin: the bystander's session never ended
    with torch.no_grad():
        assert torch.allclose(output.logits, reference(ids(seed=3)).logits, atol=1e-4)
    # The failed forward held both sessions' batches; each then ran alone.
    packs = [int(n) for n in re.findall(r"\((\d+) batches\) failed \(RuntimeError: this model cannot run",
                                        "".join(server.log_lines))]
    assert packs and max(packs) >= 2, server.log[-3000:]
    assert failed_batches(server) > failed_before
    healthy(server)


def test_deriving_outputs_that_fails_fails_that_batch_and_only_for_the_session_that_asked(server, reference):
    failed_before = failed_batches(server)
    # Both batches in one forward: the bystander's logits are fine, the victim's hidden states are not.
    error, output, (before, after, reconnects), _ = _packed_with_a_bystander(
        server, (Logits(), HiddenStates((1, 2))), SKEW)
    assert "deriving its outputs" in str(error)
    assert after == before and reconnects == 0
    with torch.no_grad():
        assert torch.allclose(output.logits, reference(ids(seed=3)).logits, atol=1e-4)
    assert failed_batches(server) > failed_before
    healthy(server)


def test_the_cli_trainer_fed_a_batch_the_teacher_cannot_run_exits_with_the_reason(server, teacher_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    student = tmp_path / "student"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(student)
    word_tokenizer().save_pretrained(student)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{i % 90 + 2}" for i in range(line, line + 20)) + " RAISE"})
                            + "\n" for line in range(8)))
    command = [sys.executable, "-m", "student_trainer", "train", "--teacher", server.address, "--model", str(student),
               "--data", str(data), "--output-dir", str(tmp_path / "run"), "--batch-size", "2", "--seq-len", "16",
               "--max-steps", "2", "--device", "cpu", "--teacher-max-resubmits", "1"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                              cwd=ROOT, timeout=90)
    except subprocess.TimeoutExpired as e:  # its output comes as bytes then
        raise AssertionError(f"the trainer still ran after 90 s:\n{e.output.decode()}") from None
    took_s = time.monotonic() - started
    print(f"trainer exited {done.returncode} after {took_s:.0f} s:", *done.stdout.splitlines()[-1:], sep="\n")
    assert done.returncode != 0, done.stdout
    assert f"this model cannot run token {RAISE}" in done.stdout, done.stdout  # the teacher's reason
    assert "Traceback" not in done.stdout, done.stdout  # a message, not a crash
    assert took_s < 60, (took_s, done.stdout)
    healthy(server)


def test_a_session_that_leaves_while_its_group_forms_ends_its_transport_process(server):
    """Not when the formation times out (2 x --join-timeout-s): the process and its store wait
    end with the session (a teacher stopping meanwhile aborted with the store's C++ waiting)."""
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)
        joined = stub.Join(pb.JoinRequest(job_id="leaves-unformed", outputs=pb.OutputSpec(logits=True),
                                          peer=pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)),
                           timeout=30)
        time.sleep(0.5)  # its transport process waits on the session's store for the student's keys
        stub.Leave(pb.LeaveRequest(session_id=joined.session_id), timeout=10,
                   metadata=((SESSION_SECRET_KEY, joined.session_secret),))
    left = time.monotonic()
    line = wait_until(lambda: next((line for line in server.log_lines if joined.session_id in line
                                    and "did not connect" in line), None), 2 * JOIN_TIMEOUT_S + 10,
                      "the teacher to end the forming group")
    assert time.monotonic() - left < 3, line
    assert "the session was ended" in line, line


def test_an_ended_session_says_why_to_its_own_student_only(server):
    """NOT_FOUND for a session the teacher ended names its reason (here: its group never formed)
    to a call with the session's secret; any other call gets the NOT_FOUND of an unknown session."""
    joined = server.unformed
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)

        def heartbeat(secret: str) -> grpc.RpcError | None:
            try:
                stub.Heartbeat(pb.HeartbeatRequest(session_id=joined.session_id), timeout=10,
                               metadata=((SESSION_SECRET_KEY, secret),))
            except grpc.RpcError as e:
                return e
            return None

        error = wait_until(lambda: heartbeat(joined.session_secret), JOIN_TIMEOUT_S + 30,
                           "the teacher to end the session that never formed")
        stranger = heartbeat("not-its-secret")
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "did not form" in error.details(), error.details()
    assert stranger.code() == grpc.StatusCode.NOT_FOUND
    assert "did not form" not in stranger.details() and "unknown or has ended" in stranger.details()
