"""A pool of teacher replicas serving real training jobs: three jobs of two data-parallel ranks
(`python -m student_trainer train` under torchrun, gloo on CPU), weights 1, 1 and 2, on three
teacher server processes named by a directory of `*.address` files (`--teacher file:DIR`, as
deploy/slurm's pool writes it).

The jobs run twice. First without a fault: the reference, while a fourth replica starts outside
the pool. Then again, and mid-run the fourth replica's address file is added (the pool sees a
replica from then on, as a pod joins its headless Service once ready) and the replica serving
the heaviest job's rank 0 is killed with SIGKILL. Then:

- every job's per-step losses (and gradient norms) equal the reference run's: each batch's
  outputs reached the step they belong to, none lost, none delivered twice;
- each session of the killed replica moved to another, the replica added taking the first, and
  delivered its first batch there within 10 s of the kill (the trainer's "serving again" line
  against the kill's time);
- the teacher tokens each job was served over the pool, summed over the replicas' own
  /v1/status while all three jobs ran (the kill and the move included), are within 20% of its
  weight's share (25%, 25%, 50%).

The teacher is the bottleneck here as in a deployment that needs a pool: a 4-layer, 256-wide
teacher on 8 x 128 tokens a batch against a 1-layer, 32-wide student, so the shares are the
replicas' to decide. The weight-2 job has twice the steps: with the shares right, all three end
together, and the window in which all three run is most of the run. Each
replica runs one batch per forward (--max-batch-tokens of one trainer batch), so a batch's
outputs do not depend on what it was packed with, and the runs can be compared to the last bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import requests

from distill_demo.corpus import write_jsonl_corpus
from distill_demo.tokenizer import train_tokenizer
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import ROOT, free_port, wait_until
from tests.test_trainer import build_llama, read_metrics

pytestmark = pytest.mark.slow

VOCAB = 300
SEQ_LEN = 128
BATCH = 8
LOSS_RTOL = 1e-6  # per-step losses against the uninterrupted run (one batch per forward: in practice equal)
SHARE_TOLERANCE = 0.2  # a job's share of the pool's tokens, relative to its weight's share
SERVING_AGAIN_S = 10.0  # from the kill to a moved session's first batch
RUN_TIMEOUT_S = 420
SAMPLE_EVERY_S = 0.2
# Batches each rank keeps asked of the teacher ahead of the one it trains on. A data-parallel job
# steps at its slowest rank's pace: a rank whose queue runs dry waiting for its job's rank on
# another replica leaves its turn to the jobs beside it, so a pool needs depth that rides out
# the replicas' jitter (docs/scaling.md).
PREFETCH = 6


@dataclass(frozen=True)
class Job:
    weight: float
    seed: int
    steps: int


JOBS = {"pool-a": Job(1.0, 1, 24), "pool-b": Job(1.0, 2, 24), "pool-c": Job(2.0, 3, 48)}
HEAVY = "pool-c"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pool-training")
    train, _ = write_jsonl_corpus(root / "corpus", max_files=4, seq_chars=1500)
    texts = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB)
    return {
        "root": root,
        "data": train,
        "teacher": build_llama(root / "teacher", vocab_size=VOCAB, hidden_size=256, layers=4, seed=0,
                               tokenizer=tokenizer),
        "student": build_llama(root / "student", vocab_size=VOCAB, hidden_size=32, layers=1, seed=1,
                               tokenizer=tokenizer),
    }


# The weights hold over a pool of replicas alike (docs/scaling.md): a replica slower than the
# others holds every job with a rank on it to its pace and gives the others its neighbours' slack.
# On a host shared with other work, replicas that each take what the scheduler gives them ran up
# to 30% apart over the test's window, and the jobs' shares drifted with them (one run: 41% off).
# So the replicas share one CPU, where each gets an equal turn, and the trainers have the others;
# where there is one CPU only, nothing is pinned.
CPUS = sorted(os.sched_getaffinity(0))
REPLICA_CPUS, TRAINER_CPUS = ({CPUS[0]}, set(CPUS[1:])) if len(CPUS) > 1 else (set(CPUS), set(CPUS))


@contextmanager
def pinned(cpus: set[int]):
    """This thread on `cpus` while the block runs: a process it starts keeps them (fork copies the
    calling thread's CPU mask)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_replicas(assets: dict, count: int) -> list[ServerProcess]:
    """`count` replicas of the teacher, started at once (each waits for READY in a thread)."""
    replicas: list = [None] * count
    errors: list = []

    def start(index: int) -> None:
        try:
            with pinned(REPLICA_CPUS):
                replicas[index] = ServerProcess("--model", str(assets["teacher"]), "--max-seq-len", str(SEQ_LEN),
                                                "--max-batch-tokens", str(BATCH * SEQ_LEN))
        except Exception as e:  # noqa: BLE001 - reported below, with the others stopped
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    if errors or not all(replicas):
        for replica in replicas:
            if replica is not None:
                replica.stop(signal.SIGKILL)
        raise AssertionError(f"a replica did not start: {errors}")
    return replicas


def add_to_pool(pool_dir: Path, replica: ServerProcess, name: str) -> None:
    """Writes the replica's address file as deploy/slurm's teacher.sbatch does: whole, then renamed."""
    partial = pool_dir / f".{name}.tmp"
    partial.write_text(f"{replica.address}\n")
    partial.rename(pool_dir / f"{name}.address")


def trainer(assets: dict, pool_dir: Path, output_dir: Path, job_id: str, job: Job) -> subprocess.Popen:
    """One job: two ranks under torchrun (`python -m torch.distributed.run`, without relying on PATH)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()),
               "-m", "student_trainer", "train", "--teacher", f"file:{pool_dir}", "--job-id", job_id,
               "--teacher-weight", str(job.weight), "--seed", str(job.seed), "--max-steps", str(job.steps),
               "--model", str(assets["student"]), "--data", str(assets["data"]), "--output-dir", str(output_dir),
               "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--device", "cpu", "--kd-weight", "0.5",
               "--lr", "3e-3", "--prefetch", str(PREFETCH), "--teacher-timeout-s", "60",
               "--teacher-reconnect-timeout-s", "120"]
    log = (output_dir.parent / f"{output_dir.name}.log").open("w")
    with pinned(TRAINER_CPUS):
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=ROOT)


def trainer_log(output_dir: Path) -> str:
    return (output_dir.parent / f"{output_dir.name}.log").read_text()


def steps_done(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


class Sampler:
    """Every replica's /v1/status (its sessions' tokens served) and every job's steps, sampled in a
    thread until stopped: `samples` is [(time, {address: {session_id: session}}, {job: steps})]."""

    def __init__(self, replicas: list[ServerProcess], output_dirs: dict[str, Path]):
        self.replicas = list(replicas)
        self.output_dirs = output_dirs
        self.samples: list[tuple[float, dict, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-sampler", daemon=True)
        self._thread.start()

    def add(self, replica: ServerProcess) -> None:
        self.replicas = [*self.replicas, replica]

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            seen = {}
            for replica in self.replicas:
                try:
                    sessions = requests.get(f"{replica.http}/v1/status", timeout=2).json()["sessions"]
                except (requests.RequestException, ValueError):
                    continue  # killed (its last answer stands), or busy past the timeout
                seen[replica.address] = {s["session_id"]: s for s in sessions}
            steps = {job: steps_done(path) for job, path in self.output_dirs.items()}
            self.samples.append((time.time(), seen, steps))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def save(self, path: Path) -> None:
        """The samples as JSON lines, for a look after the test."""
        path.write_text("".join(json.dumps({"time": t, "replicas": seen, "steps": steps}) + "\n"
                                for t, seen, steps in self.samples))

    def tokens_while_all_ran(self) -> tuple[dict[str, int], float]:
        """Tokens served to each job, summed over the replicas, from the first sample in which every
        rank of every job had been served to the last in which no job had finished; and that window's
        length in seconds. A session's tokens count from its first value in the window (0 for one
        that joined in it: a moved session's new one) to its last; a replica killed counts what it
        reported last."""
        ranks = {(job, rank) for job in JOBS for rank in range(2)}
        first = next(i for i, (_, seen, _) in enumerate(self.samples)
                     if {(s["job_id"], s["job_rank"]) for sessions in seen.values() for s in sessions.values()
                         if s["tokens_served"] > 0} >= ranks)
        last = max(i for i, (_, _, steps) in enumerate(self.samples)
                   if all(steps[job] < spec.steps for job, spec in JOBS.items()))
        assert last > first, "no sample while all three jobs ran"
        start_values: dict[tuple[str, str], int] = {}
        end_values: dict[tuple[str, str], tuple[str, int]] = {}
        for index in range(first, last + 1):
            for address, sessions in self.samples[index][1].items():
                for session_id, s in sessions.items():
                    key = (address, session_id)
                    start_values.setdefault(key, s["tokens_served"] if index == first else 0)
                    end_values[key] = (s["job_id"], s["tokens_served"])
        tokens = dict.fromkeys(JOBS, 0)
        for key, (job, value) in end_values.items():
            if job in tokens:
                tokens[job] += value - start_values[key]
        return tokens, self.samples[last][0] - self.samples[first][0]


def run_jobs(assets: dict, pool_dir: Path, run_dir: Path, replicas: list[ServerProcess],
             during=None) -> tuple[dict[str, Path], Sampler]:
    """The three jobs at once, to the end; `during(output_dirs, sampler)` runs meanwhile."""
    run_dir.mkdir()
    output_dirs = {job_id: run_dir / job_id for job_id in JOBS}
    sampler = Sampler(replicas, output_dirs)
    procs = {job_id: trainer(assets, pool_dir, output_dirs[job_id], job_id, job) for job_id, job in JOBS.items()}
    try:
        if during is not None:
            during(output_dirs, sampler, procs)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for job_id, proc in procs.items():
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"job {job_id} did not finish within {RUN_TIMEOUT_S}s:\n"
                                     f"{trainer_log(output_dirs[job_id])}") from None
            assert proc.returncode == 0, trainer_log(output_dirs[job_id])
    finally:
        sampler.stop()
        sampler.save(run_dir / "status.jsonl")
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return output_dirs, sampler


def share_errors(tokens: dict[str, int]) -> dict[str, float]:
    """Each job's share of the tokens, relative to its weight's share, minus 1."""
    total, weight_total = sum(tokens.values()), sum(job.weight for job in JOBS.values())
    return {job: tokens[job] / total / (JOBS[job].weight / weight_total) - 1 for job in JOBS}


# A trainer's "serving again" line (tqdm's progress bar, which ends in a carriage return, may precede it).
LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) WARNING \[rank (\d)\] student_trainer\.client: "
                      r"teacher (\S+) serving again: ")


def test_three_jobs_on_a_pool_lose_nothing_to_a_replica_killed_and_keep_their_weights(assets, tmp_path):
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    began = time.monotonic()
    replicas = start_replicas(assets, 3)
    fourth: list[ServerProcess] = []
    try:
        for index, replica in enumerate(replicas):
            add_to_pool(pool_dir, replica, f"replica{index}")
        started_s = time.monotonic() - began

        # The reference: the same jobs on the same pool, nothing killed. Meanwhile a fourth replica
        # starts, outside the pool until its address file is written (as a Kubernetes pod is out of
        # its headless Service until ready, and deploy/slurm's teacher writes its file once up).
        starting = threading.Thread(target=lambda: fourth.extend(start_replicas(assets, 1)))
        starting.start()
        reference_dirs, reference = run_jobs(assets, pool_dir, tmp_path / "reference", replicas)
        reference_s = time.monotonic() - began - started_s
        starting.join(180)
        assert fourth, "the fourth replica did not start"

        killed: dict = {}

        def add_a_replica_then_kill_one(output_dirs, sampler, procs) -> None:
            def running() -> bool:
                return all(proc.poll() is None for proc in procs.values())

            wait_until(lambda: steps_done(output_dirs[HEAVY]) >= 4 or not running(), RUN_TIMEOUT_S,
                       "the heavy job's fourth step", interval_s=0.02)
            add_to_pool(pool_dir, fourth[0], "replica3")  # the pool sees it from the next join on
            sampler.add(fourth[0])
            by_address = {replica.address: replica for replica in replicas}
            sessions = {address: requests.get(f"{replica.http}/v1/status", timeout=10).json()["sessions"]
                        for address, replica in by_address.items()}
            victim = next(address for address, listed in sessions.items()
                          if any(s["job_id"] == HEAVY and s["job_rank"] == 0 for s in listed))
            steps = {job: steps_done(path) for job, path in output_dirs.items()}
            # A rank holds at most PREFETCH + 1 steps' outputs ahead: with more left, the kill takes
            # batches it has not received.
            assert all(steps[job] + PREFETCH + 2 < spec.steps for job, spec in JOBS.items()), steps
            killed.update(time=time.time(), address=victim, steps=steps,
                          moved={(s["job_id"], s["job_rank"]) for s in sessions[victim]})
            by_address[victim].stop(signal.SIGKILL)

        run_dirs, sampler = run_jobs(assets, pool_dir, tmp_path / "killed", replicas, add_a_replica_then_kill_one)
        killed_s = time.monotonic() - began - started_s - reference_s
    finally:
        for replica in [*replicas, *fourth]:
            replica.stop(signal.SIGKILL)
    print(f"replicas started in {started_s:.1f} s, the reference run took {reference_s:.1f} s, the run with the "
          f"kill {killed_s:.1f} s")

    # What the replicas served each job while all three ran, and when each moved session
    # delivered again (its trainer's "serving again" line, against the kill's time).
    tokens, window_s = sampler.tokens_while_all_ran()
    reference_tokens, reference_window_s = reference.tokens_while_all_ran()
    served_again = {}
    for job_id in JOBS:
        for stamp, rank, address in LOG_TIME.findall(trainer_log(run_dirs[job_id])):
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            served_again[(job_id, int(rank))] = (address, at - killed["time"])
    print(f"at the kill: {killed}; served again: {served_again}; tokens over {window_s:.1f} s: {tokens}, off the "
          f"weights by {share_errors(tokens)}; reference over {reference_window_s:.1f} s: {reference_tokens}, "
          f"{share_errors(reference_tokens)}")

    # Every step of every job: the uninterrupted run's losses.
    for job_id, job in JOBS.items():
        expected, got = read_metrics(reference_dirs[job_id]), read_metrics(run_dirs[job_id])
        assert [r["step"] for r in expected] == [r["step"] for r in got] == list(range(1, job.steps + 1)), job_id
        for a, b in zip(expected, got):
            for key in ("loss", "kd", "ce", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=LOSS_RTOL, abs=1e-12), (job_id, a["step"], key)

    # Each session of the killed replica joined another and delivered a batch again within
    # SERVING_AGAIN_S of the kill; the replica added took the first of them (it had none: the
    # fewest of every job's sessions and the least weight), the others where placement put them.
    assert set(served_again) == killed["moved"], (served_again, killed)
    for (job_id, rank), (address, after_s) in served_again.items():
        assert address != killed["address"], (job_id, rank, address)
        assert 0 < after_s <= SERVING_AGAIN_S, (job_id, rank, after_s)
    assert fourth[0].address in {address for address, _ in served_again.values()}, served_again

    # Each job's share of the pool's tokens while all three ran, the kill and the move included.
    errors = share_errors(tokens)
    assert all(abs(error) <= SHARE_TOLERANCE for error in errors.values()), (tokens, errors)
