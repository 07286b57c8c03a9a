"""A pool of teacher replicas behind one name (student_trainer/pool.py): sessions placed by
load and spread by rank, a replica killed with SIGKILL mid-run costs nothing (each batch
delivered once, equal to the model run here), a replica added later takes new joins, and a
pool that mixes two teachers is refused naming the replica.

Real parts: teacher server processes, TeacherClient in this process, gloo on CPU.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from student_trainer import TeacherClient
from student_trainer.errors import Incompatible
from student_trainer.pool import Pool
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


class Board:
    """What the replicas of a pool say of their sessions (GetStatus), kept here: placement's view."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.sessions: dict[str, list[pb.SessionStatus]] = {address: [] for address in addresses}
        self.lock = threading.Lock()

    def join(self, address: str, job_id: str, job_rank: int, weight: float, job_size: int = 2) -> str:
        """A session of the job's weight over `job_size` ranks, its group formed; its id."""
        with self.lock:
            session_id = f"{job_id}{job_rank}"
            self.sessions[address].append(pb.SessionStatus(session_id=session_id, job_id=job_id, job_rank=job_rank,
                                                           weight=weight / job_size, state="ready"))
            return session_id

    def leave(self, session_id: str) -> None:
        with self.lock:
            for listed in self.sessions.values():
                listed[:] = [s for s in listed if s.session_id != session_id]

    def where(self) -> dict[str, list[str]]:
        return {address: sorted(s.session_id for s in listed) for address, listed in self.sessions.items()}

    def connect(self, address: str):
        board = self

        class Replica:
            def call(self, method: str, request, timeout_s: float):
                assert method == "GetStatus"
                with board.lock:
                    listed = list(board.sessions[address])
                return pb.StatusResponse(info=pb.TeacherInfo(max_inflight=8, max_sessions=8),
                                         sessions=listed, sessions_total=len(listed),
                                         weight_total=sum(s.weight for s in listed))

            def close(self):
                pass

        return Replica()


@pytest.mark.parametrize("in_rank_order", [True, False])
def test_a_jobs_ranks_place_themselves_in_rank_order_so_other_joins_meanwhile_cannot_crowd_them(in_rank_order):
    """Rank 1 of job "j" chooses while rank 0 has not joined yet, and another job's session joins
    in between: rank 1 waits for rank 0 to be in place, and goes elsewhere. Guessing where rank 0
    would go instead (no wait) guesses from a view rank 0 no longer has, and both land on one replica."""
    board = Board(["r0:1", "r1:1", "r2:1"])
    board.join("r0:1", "x", 0, 1.0, job_size=1)
    pool = Pool(",".join(board.addresses), board.connect)
    chosen: dict[int, str] = {}

    def rank_1() -> None:
        chosen[1], _ = pool.choose("j", 1, 0.5, lower_ranks_wait_s=10.0 if in_rank_order else 0.0)

    thread = threading.Thread(target=rank_1)
    thread.start()
    time.sleep(0.3)
    board.join("r1:1", "y", 0, 1.0, job_size=1)  # another job's session, after rank 1 looked and before rank 0 does
    chosen[0], _ = pool.choose("j", 0, 0.5)
    board.join(chosen[0], "j", 0, 1.0)
    thread.join(15)
    assert chosen[0] == "r2:1"  # the one replica without a session
    assert (chosen[1] != chosen[0]) is in_rank_order, chosen


def test_sessions_that_joined_at_once_and_landed_together_spread_when_they_look_again():
    """Three jobs' rank 0 joined at the same moment, saw the same empty pool and took the same
    replica; each looks again (Pool.better_replica), one after another: the first two move to
    the replicas left empty, the last stays."""
    board = Board(["r0:1", "r1:1", "r2:1"])
    pool = Pool(",".join(board.addresses), board.connect)
    for job, weight in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        board.join("r0:1", job, 0, weight)
    for job, weight in (("b", 1.0), ("a", 1.0), ("c", 2.0)):
        better = pool.better_replica(job, 0, weight / 2, f"{job}0", "r0:1")
        if better is not None:
            board.leave(f"{job}0")
            board.join(better, job, 0, weight)
    assert sorted(map(len, board.where().values())) == [1, 1, 1], board.where()
    assert board.where()["r0:1"] == ["c0"]
    # A session alone where it is, or where moving would only trade places, stays.
    assert all(pool.better_replica(job, 0, w / 2, f"{job}0", at) is None
               for at, job, w in (("r0:1", "c", 2.0), ("r1:1", "b", 1.0), ("r2:1", "a", 1.0)))
