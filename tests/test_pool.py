"""A pool of teacher replicas behind one name (student_trainer/pool.py): sessions placed by
load and spread by rank, a replica killed with SIGKILL mid-run costs nothing (each batch
delivered once, equal to the model run here), a replica added later takes new joins, and a
pool that mixes two teachers is refused naming the replica.

Real parts: teacher server processes, TeacherClient in this process, gloo on CPU.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from student_trainer import TeacherClient
from student_trainer.errors import Incompatible
from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model, status_sessions, wait_until

VOCAB = 384


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pool") / "model", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def _expected(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _replicas(model_dir, count: int) -> list[ServerProcess]:
    return [ServerProcess("--model", str(model_dir)) for _ in range(count)]


@pytest.mark.slow
def test_a_job_spreads_over_the_replicas_and_outlives_one_killed_mid_run(model_dir, model, tmp_path):
    replicas = _replicas(model_dir, 2)
    pool_file = tmp_path / "replicas.txt"
    pool_file.write_text("".join(f"{r.address}\n" for r in replicas))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=generator) for _ in range(12)]
    clients = []
    try:
        clients = [TeacherClient(f"file:{pool_file}", "cpu", job_id="pooled", job_rank=rank, job_size=3,
                                 reconnect_timeout_s=60) for rank in range(2)]
        where = [client.address for client in clients]
        assert sorted(where) == sorted(r.address for r in replicas)  # one rank on each replica
        results: dict[int, list] = {0: [], 1: []}

        def run(rank: int, client: TeacherClient, killed: threading.Event) -> None:
            for index, ids in enumerate(batches):
                if rank == 0 and index == 4:
                    killed.wait(60)
                results[rank].append(client.submit(ids))

        killed = threading.Event()
        threads = [threading.Thread(target=run, args=(rank, client, killed)) for rank, client in enumerate(clients)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(results[0]) >= 4, 60, "rank 0's first batches")
        results[0][3].result(timeout=60)
        victim = next(r for r in replicas if r.address == clients[0].address)
        victim.stop(signal.SIGKILL)  # rank 0's replica, mid-run: its later batches must go to the other
        killed.set()
        for thread in threads:
            thread.join(60)
        for rank, futures in results.items():
            assert len(futures) == len(batches)
            for ids, future in zip(batches, futures):
                out = future.result(timeout=120)
                torch.testing.assert_close(out.logits, _expected(model, ids), atol=2e-5, rtol=0)
        survivor = next(r for r in replicas if r is not victim)
        assert clients[0].address == survivor.address and clients[0].reconnects == 1
        # Both ranks now on the survivor, each batch served once by it after the move.
        sessions = status_sessions(f"http://127.0.0.1:{survivor.http_port}")
        assert sorted(s["job_rank"] for s in sessions.values() if s["job_id"] == "pooled") == [0, 1]

        # A replica added to the pool's file takes the next join (it has none of this job's sessions).
        added = ServerProcess("--model", str(model_dir))
        replicas.append(added)
        pool_file.write_text(f"{victim.address}\n{survivor.address}\n{added.address}\n")
        with TeacherClient(f"file:{pool_file}", "cpu", job_id="pooled", job_rank=2, job_size=3) as third:
            assert third.address == added.address
            torch.testing.assert_close(third.submit(batches[0]).result(timeout=60).logits,
                                       _expected(model, batches[0]), atol=2e-5, rtol=0)
    finally:
        for client in clients:
            client.close(timeout_s=10)
        for replica in replicas:
            replica.stop(signal.SIGKILL)


def test_a_pool_that_mixes_two_teachers_is_refused_naming_the_replica(model_dir, tmp_path):
    other_dir = build_tiny_model(tmp_path / "other", vocab_size=VOCAB, seed=1)  # same shapes, other weights
    same, other = ServerProcess("--model", str(model_dir)), ServerProcess("--model", str(other_dir))
    try:
        for job_rank in (0, 1):  # whichever replica the session joins, the other one is named
            with pytest.raises(Incompatible, match="replica .* serves another teacher .*weights_fingerprint"):
                TeacherClient(f"{same.address},{other.address}", "cpu", job_id="mixed", job_rank=job_rank)
        assert not status_sessions(f"http://127.0.0.1:{same.http_port}")  # the refused join left
        with TeacherClient(f"{same.address}", "cpu", job_id="single") as client:  # a pool of one asks nothing
            assert client.address == same.address
    finally:
        same.stop(signal.SIGKILL)
        other.stop(signal.SIGKILL)


@pytest.mark.slow
def test_status_of_a_pool_lists_every_replica(model_dir, tmp_path):
    import subprocess
    import sys

    from teacher_server.launcher import child_env
    from tests.helpers import ROOT

    replica = ServerProcess("--model", str(model_dir))
    try:
        pool_file = tmp_path / "pool.txt"
        pool_file.write_text(f"{replica.address}\n127.0.0.1:1  # a replica that is down\n")
        result = subprocess.run([sys.executable, "-m", "teacher_server", "info", f"file:{pool_file}", "--timeout-s",
                                 "3"], capture_output=True, text=True, timeout=60, env=child_env(), cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert f"== {replica.address}\n" in result.stdout and "architecture" in result.stdout
        assert "== 127.0.0.1:1\n(no answer: 127.0.0.1:1 answered UNAVAILABLE" in result.stdout
    finally:
        replica.stop(signal.SIGKILL)
