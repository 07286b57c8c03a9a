"""Several student jobs on one teacher: exact outputs, weighted shares, admission.

Three jobs (one of two ranks: two processes with the same job id) join at different
times, check their outputs against the model run locally, then all saturate the
teacher. Over a window of a few seconds each job's share of the tokens served must
be within 20% of its weight's share; the weight is per job, so the 2-rank job gets
no more than the 1-rank job of the same weight. A fifth session is refused by
--max-sessions.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from student_trainer import TeacherClient
from student_trainer.errors import InvalidRequest, LimitExceeded
from teacher_server.launcher import ServerProcess, child_env, metrics_samples
from tests.helpers import build_tiny_model, finish_student, start_student, wait_for_line

TOLERANCE = 1e-4
JOBS = {"job-a": (1.0, 1), "job-b": (1.0, 2), "job-c": (2.0, 1)}  # weight, ranks
WINDOW_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Wider than the default tiny model so that a forward, not the students, is the
    # bottleneck when four processes share two cores.
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", layers=4, hidden_size=192)


@pytest.fixture(scope="module")
def env():
    # One thread per process: two OpenMP threads on two shared cores stall at every
    # barrier whenever the other process runs (forwards 10-30x slower, at random).
    return child_env(OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def server(model_dir, env):
    server = ServerProcess("--model", str(model_dir), "--max-sessions", "4", "--max-inflight", "8",
                           "--max-batch-tokens", "512", "--max-seq-len", "64", env=env)
    yield server
    assert server.stop() == 0, server.log


def test_every_rank_of_a_job_gives_the_same_weight(server):
    with TeacherClient(server.address, "cpu", job_id="weighted", job_rank=0, weight=2.0):
        with pytest.raises(InvalidRequest, match="already has weight 2.*same weight"):
            TeacherClient(server.address, "cpu", job_id="weighted", job_rank=1, weight=1.0)
        with TeacherClient(server.address, "cpu", job_id="weighted", job_rank=1, weight=2.0):
            pass


def _job_tokens(http: str) -> dict[str, float]:
    tokens: dict[str, float] = defaultdict(float)
    for (name, labels), value in metrics_samples(http).items():
        if name == "teacher_tokens_total":
            tokens[dict(labels)["job"]] += value
    return tokens


def test_jobs_get_exact_outputs_and_weighted_shares(server, model_dir, env, tmp_path):
    stop = tmp_path / "stop"
    students = []
    try:
        for job, (weight, ranks) in JOBS.items():
            for rank in range(ranks):
                out = tmp_path / f"{job}-{rank}.json"
                proc = start_student(server.address, model_dir, out, "--job-id", job, "--job-rank", str(rank),
                                     "--weight", str(weight), "--seed", str(len(students)), "--batches", "4",
                                     "--inflight", "8", "--shape", "4x64", "--join-file", str(tmp_path / job),
                                     "--saturate-until-file", str(stop), env=env)
                students.append((job, proc, out))
        for _, proc, _ in students:
            wait_for_line(proc, "LOADED")  # started together: imports do not compete with a busy teacher
        # Joined at different times, each job into a busy teacher: a alone, then both
        # ranks of b once a saturates it, then c once b does too.
        for job in JOBS:
            (tmp_path / job).touch()
            for _, proc, _ in (s for s in students if s[0] == job):
                wait_for_line(proc, "JOINED")
            for _, proc, _ in (s for s in students if s[0] == job):
                wait_for_line(proc, "SATURATING")  # outputs checked; now submitting back to back

        with pytest.raises(LimitExceeded, match="--max-sessions 4"):  # asked again while full, for join_timeout_s
            TeacherClient(server.address, "cpu", job_id="one-too-many", join_timeout_s=2)

        time.sleep(0.5)  # the newest session's first unchecked batches are through
        start_tokens = _job_tokens(server.http)
        depths = []
        deadline = time.monotonic() + WINDOW_S
        while time.monotonic() < deadline:
            depths.append(metrics_samples(server.http)[("teacher_queue_depth", ())])
            time.sleep(0.25)
        end_tokens = _job_tokens(server.http)
        stop.touch()
        reports = {(job, i): finish_student(proc, out) for i, (job, proc, out) in enumerate(students)}
    finally:
        stop.touch()
        for _, proc, _ in students:
            if proc.poll() is None:
                proc.kill()

    for (job, _), report in reports.items():
        assert report["received"] == list(range(4)), (job, report)
        for kind, diff in report["worst"].items():
            assert diff <= TOLERANCE, (job, kind, diff, report)
        assert report["saturated_batches"] > 0, (job, report)

    # Saturated: batches were waiting for the teacher throughout the window.
    assert min(depths) >= 1, depths
    served = {job: end_tokens[job] - start_tokens[job] for job in JOBS}
    total = sum(served.values())
    total_weight = sum(weight for weight, _ in JOBS.values())
    assert total > 0
    for job, (weight, _) in JOBS.items():
        share, fair = served[job] / total, weight / total_weight
        assert abs(share - fair) <= 0.2 * fair, f"{job}: share {share:.3f} vs weight share {fair:.3f} ({served})"
