"""A teacher killed with SIGKILL mid-run and started again on the same ports: its clients
join again, re-submit what they lack, and a training run goes on as if nothing happened.

Real parts throughout: a teacher server process, `python -m student_trainer train` in a
child process, TeacherClient in this one, gloo on CPU. To kill the teacher while batches
are in flight, it is first frozen (SIGSTOP): whatever is submitted after that cannot have
been served, so the test knows which batches the restarted teacher must see.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import train_tokenizer
from student_trainer import Logits, TeacherClient, TopK
from student_trainer.errors import TeacherUnavailable
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import ROOT, status_sessions, wait_until
from tests.test_trainer import build_llama, read_metrics

VOCAB = 300
SEQ_LEN = 64
BATCH = 4
STEPS = 24
TOLERANCE = 1e-4  # teacher outputs against the same model run here
LOSS_RTOL = 1e-6  # per-step losses against the uninterrupted run (one batch per forward: in practice equal)
TRAINER_TIMEOUT_S = 180


class RestartableTeacher:
    """The module's teacher server, which tests freeze, kill -9 and start again on the same ports."""

    def __init__(self, *args: str):
        self.args = args
        self.server: ServerProcess | None = None
        self.ports = (0, 0)  # any free ports at first, then the first server's
        self.killed_logs: list[str] = []

    def running(self) -> ServerProcess:
        if self.server is None or self.server.proc.poll() is not None:
            self.server = ServerProcess(*self.args, ports=self.ports)
            self.ports = self.server.ports
        return self.server

    def freeze(self) -> None:
        """SIGSTOP, and wait until the kernel shows it stopped: from now on it serves nothing."""
        pid = self.server.proc.pid
        self.server.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 10,
                   "the teacher to stop")

    def kill(self) -> None:
        self.server.stop(signal.SIGKILL)
        self.killed_logs.append(self.server.log)

    def restart(self) -> ServerProcess:
        self.kill()
        return self.running()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("restart")
    train, _ = write_jsonl_corpus(root / "corpus", max_files=4, seq_chars=1500)
    texts = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    assert len(tokenizer) == VOCAB
    return {
        "data": train,
        "teacher": build_llama(root / "teacher", vocab_size=VOCAB, hidden_size=64, layers=2, seed=0,
                               tokenizer=tokenizer),
        "student": build_llama(root / "student", vocab_size=VOCAB, hidden_size=32, layers=1, seed=1,
                               tokenizer=tokenizer),
    }


@pytest.fixture(scope="module")
def teacher(assets):
    # One batch per forward (--max-batch-tokens = one trainer batch): the teacher's outputs
    # for a batch then do not depend on what it happened to be packed with, so a run that
    # crosses a restart can be compared with one that did not, to the last bit.
    teacher = RestartableTeacher("--model", str(assets["teacher"]), "--max-seq-len", str(SEQ_LEN),
                                 "--max-batch-tokens", str(BATCH * SEQ_LEN))
    yield teacher
    teacher.close()


@pytest.fixture
def thread_errors():
    """Exceptions raised in any thread (a future resolved twice would raise InvalidStateError)."""
    errors, previous = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(f"{args.thread.name}: {args.exc_type.__name__}: "
                                                      f"{args.exc_value}")
    yield errors
    threading.excepthook = previous


def session_status(server: ServerProcess, session_id: str) -> dict | None:
    return status_sessions(server.http).get(session_id)


# ---- the client ----------------------------------------------------------------------------


@pytest.mark.slow  # a kill -9 and restart of its own; the training across a kill -9 (default suite) repeats it end to end
def test_every_future_resolves_once_in_order_across_a_kill_9(teacher, assets, thread_errors):
    from transformers import AutoModelForCausalLM

    server = teacher.running()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(10)]
    masks = [None] * len(batches)
    masks[6] = torch.ones(2, 16, dtype=torch.int64)
    masks[6][1, 11:] = 0  # right padding: the mask must travel again with its batch
    expected = [b.clone() for b in batches]
    delivered_first, resolved = 3, []
    with TeacherClient(server.address, "cpu", outputs=(Logits(), TopK(4)), max_inflight=8, job_id="restart-client",
                       reconnect_timeout_s=120) as client:
        first_session = client.session_id
        futures = [client.submit(ids, masks[i]) for i, ids in enumerate(batches[:delivered_first])]
        for future in futures:
            future.result(timeout=60)
        teacher.freeze()
        for i in range(delivered_first, len(batches)):
            futures.append(client.submit(batches[i], masks[i]))
            batches[i].zero_()  # the caller reuses its tensors: the client re-sends its own copy
        for i, future in enumerate(futures):
            future.add_done_callback(lambda _, i=i: resolved.append(i))
        server = teacher.restart()
        outputs = [future.result(timeout=120) for future in futures]
        status = session_status(server, client.session_id)
        assert client.reconnects == 1 and client.session_id != first_session
    assert not thread_errors, thread_errors
    assert resolved == list(range(len(batches))), resolved  # in submit order, each once
    assert [out.batch_id for out in outputs] == list(range(len(batches)))
    # The frozen teacher served none of the later batches and the new one none of the earlier ones.
    assert status is not None and status["batches_submitted"] == len(batches) - delivered_first, status
    assert "did not come back" not in server.log

    model = AutoModelForCausalLM.from_pretrained(assets["teacher"]).eval()
    for i, (ids, mask, out) in enumerate(zip(expected, masks, outputs)):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        assert (out.logits - logits)[real].abs().max().item() <= TOLERANCE, i
        values, _ = torch.topk(torch.log_softmax(logits, dim=-1), 4, dim=-1)
        assert (out.topk_values - values)[real].abs().max().item() <= TOLERANCE, i


# ---- a training run --------------------------------------------------------------------------


def trainer_command(server: ServerProcess, assets: dict, output_dir: Path) -> list[str]:
    return [sys.executable, "-m", "student_trainer", "train", "--teacher", server.address,
            "--model", str(assets["student"]), "--data", str(assets["data"]), "--output-dir", str(output_dir),
            "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--device", "cpu", "--max-steps", str(STEPS),
            "--kd-weight", "0.5", "--lr", "3e-3", "--prefetch", "2", "--teacher-timeout-s", "60",
            "--teacher-reconnect-timeout-s", "120"]


def start_trainer(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            cwd=ROOT)


def finish(proc: subprocess.Popen) -> str:
    try:
        output, _ = proc.communicate(timeout=TRAINER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"the trainer did not finish within {TRAINER_TIMEOUT_S}s:\n{output}") from None
    assert proc.returncode == 0, output
    return output


def logged_steps(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_training_across_a_teacher_kill_9_repeats_the_uninterrupted_losses(teacher, assets, tmp_path):
    server = teacher.running()
    reference_dir, restarted_dir = tmp_path / "reference", tmp_path / "restarted"
    finish(start_trainer(trainer_command(server, assets, reference_dir)))

    trainer = start_trainer(trainer_command(server, assets, restarted_dir))
    try:
        # Polled often: a step of these tiny models takes milliseconds, and a slow poll let the run
        # reach its last steps before the freeze.
        wait_until(lambda: logged_steps(restarted_dir) >= 3 or trainer.poll() is not None, TRAINER_TIMEOUT_S,
                   "the trainer's third step", interval_s=0.002)
        teacher.freeze()
        # With --prefetch 2 the trainer holds the outputs of at most 3 steps ahead: with more
        # steps left than that, it needs batches the frozen teacher will never send.
        steps_at_kill = logged_steps(restarted_dir)
        assert steps_at_kill + 3 < STEPS, f"the run got too far ({steps_at_kill} steps) before the teacher froze"
        teacher.restart()
    except BaseException:
        trainer.kill()
        teacher.kill()  # not left frozen for the module's next test: it starts a teacher of its own
        raise
    output = finish(trainer)
    assert "reconnected to teacher" in output, output
    assert "re-submitted 0 batches" not in output, output

    reference, restarted = read_metrics(reference_dir), read_metrics(restarted_dir)
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert [r["step"] for r in restarted] == list(range(1, STEPS + 1))
    for a, b in zip(reference, restarted):
        for key in ("loss", "kd", "ce", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-12), (a["step"], key, a[key], b[key])


# ---- a teacher that does not come back (last: it leaves none running) ---------------------------


def test_futures_fail_naming_the_timeout_when_the_teacher_stays_down(teacher):
    server = teacher.running()
    with TeacherClient(server.address, "cpu", job_id="restart-never", reconnect_timeout_s=2) as client:
        client.submit(torch.randint(0, VOCAB, (1, 8))).result(timeout=60)
        teacher.freeze()
        futures = [client.submit(torch.randint(0, VOCAB, (1, 8))) for _ in range(3)]
        killed = time.monotonic()  # before kill(), which also waits for the teacher's output to end
        teacher.kill()
        for future in futures:
            with pytest.raises(TeacherUnavailable, match=r"reconnect_timeout_s=2s") as failure:
                future.result(timeout=60)
            assert "--teacher-reconnect-timeout-s" in str(failure.value)
        waited_s = time.monotonic() - killed
        assert 1.9 <= waited_s < 30, waited_s  # it did try for the whole timeout, then gave up
        with pytest.raises(TeacherUnavailable, match="did not come back"):
            client.submit(torch.randint(0, VOCAB, (1, 8)))
