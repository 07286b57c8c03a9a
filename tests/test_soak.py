"""Soak: eight student processes against one CPU teacher for ten minutes, with random joins,
leaves (students that finish their batches) and kill -9s.

Checked: every student that was not killed received each of its batches exactly once, in
order (batch ids 0..n-1), every third one equal to the local model's outputs; the teacher
stays up, ends every session (/v1/status empty, /metrics: joined == ended) and its memory
is bounded (the largest RSS of the last quarter of the run is not above the largest of the
first quarter by more than a margin), and its thread count comes back down. A table of
figures is printed at the end.

    SOAK_DURATION_S=600 pytest -q -s -m slow tests/test_soak.py     # the full run (default)
    SOAK_DURATION_S=90 pytest -q -s -m slow tests/test_soak.py      # a short one
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from teacher_server.launcher import ServerProcess, metrics_samples
from tests.helpers import build_tiny_model, start_student, status_sessions, wait_until

DURATION_S = float(os.environ.get("SOAK_DURATION_S", "600"))
STUDENTS = int(os.environ.get("SOAK_STUDENTS", "8"))
SEED = int(os.environ.get("SOAK_SEED", "0"))
MEAN_KILL_INTERVAL_S = 10.0
# Eight students and a teacher on two cores: a student can be starved for seconds, which
# must not look like death. Leases and transfer deadlines are generous accordingly.
LEASE_S = 10.0
TRANSFER_TIMEOUT_S = 15.0
# Memory bound: the last quarter's largest RSS may exceed the first quarter's by this much.
RSS_MARGIN_BYTES = 96 << 20
RSS_MARGIN_FRACTION = 0.10
THREAD_MARGIN = 8

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(DURATION_S) + 600)]


def _process_memory(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of a process: psutil if installed, else /proc."""
    try:
        import psutil
    except ImportError:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])
    process = psutil.Process(pid)
    return process.memory_info().rss, process.num_threads()


class Sampler(threading.Thread):
    """The teacher's RSS and thread count, once a second."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int, int]] = []  # (monotonic, rss, threads)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss, threads = _process_memory(self.pid)
            except (OSError, KeyError):
                return  # the teacher is gone: the test sees it
            self.samples.append((time.monotonic(), rss, threads))
            self.stop.wait(1.0)

    def quarter_max(self, first: bool) -> int:
        start, end = self.samples[0][0], self.samples[-1][0]
        quarter = (end - start) / 4
        return max(rss for t, rss, _ in self.samples if (t <= start + quarter if first else t >= end - quarter))


@dataclass
class Student:
    number: int
    proc: subprocess.Popen
    out: Path
    batches: int
    killed: bool = False
    joined: threading.Event = field(default_factory=threading.Event)
    output: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Reads the child's output as it comes (a full pipe would block it) and notes its join.
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("JOINED"):
                self.joined.set()


def _metrics(server) -> dict[str, float]:
    values: dict[str, float] = {}
    for (name, labels), value in metrics_samples(server.http).items():
        labels = dict(labels)
        if not (set(labels) & {"session", "job"}):
            key = name + (f"{{{labels['reason']}}}" if "reason" in labels else "")
            values[key] = values.get(key, 0.0) + value
    return values


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def test_soak(tmp_path):
    rng = random.Random(SEED)
    model_dir = build_tiny_model(tmp_path / "model")
    server = ServerProcess("--model", str(model_dir), "--lease-s", str(LEASE_S), "--heartbeat-interval-s", "1",
                           "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--join-timeout-s", "120",
                           "--max-sessions", "32", "--max-batch-tokens", "2048", "--max-seq-len", "256")
    sampler = Sampler(server.proc.pid)
    threads_at_start = _process_memory(server.proc.pid)[1]
    sampler.start()
    live: list[Student] = []
    done: list[Student] = []
    failures: list[str] = []
    figures = {"joins": 0, "kills": 0, "kills_mid_transfer": 0, "leaves": 0, "batches": 0, "checked": 0,
               "tokens": 0}
    started_at = time.monotonic()
    next_kill = started_at + rng.expovariate(1 / MEAN_KILL_INTERVAL_S)

    def start_one() -> None:
        number = figures["joins"]
        batches = rng.randint(10, 60)
        kinds = rng.choice([(), ("--no-logits",), ("--topk", "0", "--hidden-layers", "")])
        out = tmp_path / f"student{number}.json"
        proc = start_student(server.address, model_dir, out, "--batches", str(batches), "--check-every", "3",
                             "--inflight", str(rng.randint(1, 4)), "--max-len", str(rng.choice([16, 48, 128])),
                             "--pause-s", f"{rng.uniform(0, 0.05):.3f}", "--seed", str(SEED * 10_000 + number),
                             "--job-id", f"soak-{number}", *kinds)
        live.append(Student(number, proc, out, batches))
        figures["joins"] += 1

    def reap(student: Student) -> None:
        student.proc.wait(timeout=60)
        student.reader.join(10)
        output = "".join(student.output)
        done.append(student)
        if student.killed and student.proc.returncode == -signal.SIGKILL:
            return
        if student.proc.returncode != 0:
            failures.append(f"student {student.number} exited with {student.proc.returncode}:\n{output[-3000:]}")
            return
        report = json.loads(student.out.read_text())
        if report["received"] != list(range(student.batches)):
            failures.append(f"student {student.number}: batch ids {report['received']} "
                            f"are not 0..{student.batches - 1}")
        worst = max(report["worst"].values())
        if worst > 1e-4:
            failures.append(f"student {student.number}: outputs differ from the local model by {worst}")
        figures["leaves"] += 1
        figures["batches"] += len(report["received"])
        figures["checked"] += report["checked"]
        figures["tokens"] += report["tokens"]

    try:
        while time.monotonic() - started_at < DURATION_S:
            assert server.proc.poll() is None, f"the teacher died:\n{server.log[-5000:]}"
            for student in [s for s in live if s.proc.poll() is not None]:
                live.remove(student)
                reap(student)
            # Joins: top up to STUDENTS, one newcomer at a time (each start costs seconds of CPU).
            if len(live) < STUDENTS and rng.random() < 0.5:
                start_one()
            # Kills: a student that joined, preferably one with batches in flight at the teacher.
            joined = {f"soak-{s.number}": s for s in live if s.joined.is_set()}
            if time.monotonic() >= next_kill and joined:
                busy = [joined[s["job_id"]] for s in status_sessions(server.http).values()
                        if s["job_id"] in joined and s["inflight"]]
                victim = rng.choice(busy or list(joined.values()))
                figures["kills_mid_transfer"] += bool(busy)
                victim.proc.kill()
                victim.killed = True
                live.remove(victim)
                reap(victim)
                figures["kills"] += victim.proc.returncode == -signal.SIGKILL
                next_kill = time.monotonic() + rng.expovariate(1 / MEAN_KILL_INTERVAL_S)
            time.sleep(0.5)
        # Wind down: no more joins or kills; the live students finish their batches.
        for student in live:
            try:
                student.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                failures.append(f"student {student.number} did not finish within 300 s")
                student.proc.kill()
            reap(student)
        live.clear()
        # Killed students' sessions end by lease or transfer timeout; nothing stays behind.
        wait_until(lambda: not status_sessions(server.http),
                   LEASE_S + TRANSFER_TIMEOUT_S + 30, "every session to end after the soak")
        metrics = _metrics(server)
        # Sender and connect threads of the last sessions exit; idle workers of the HTTP
        # server's thread pool retire after 10 s.
        time.sleep(12)
        threads_at_end = _process_memory(server.proc.pid)[1]
        thread_names = sorted(Path(f"/proc/{server.proc.pid}/task/{t}/comm").read_text().strip()
                              for t in os.listdir(f"/proc/{server.proc.pid}/task"))
    finally:
        sampler.stop.set()
        for student in live:
            student.proc.kill()
            student.proc.communicate(timeout=60)
        server_rc = server.stop()
    sampler.join(5)

    rss = [r for _, r, _ in sampler.samples]
    first, last = sampler.quarter_max(first=True), sampler.quarter_max(first=False)
    ended = {k[len("teacher_sessions_ended_total{"):-1]: int(v) for k, v in metrics.items()
             if k.startswith("teacher_sessions_ended_total{")}
    rows = [
        ("duration", f"{time.monotonic() - started_at:.0f} s (soak {DURATION_S:.0f} s, then wind-down)"),
        ("students started (joins)", figures["joins"]),
        ("finished their batches (leaves)", figures["leaves"]),
        ("killed -9 (of which with batches in flight)", f"{figures['kills']} ({figures['kills_mid_transfer']})"),
        ("batches received by finished students", figures["batches"]),
        ("  of which compared with the local model", figures["checked"]),
        ("tokens of those batches", figures["tokens"]),
        ("teacher forward tokens (padding included)", int(metrics.get("teacher_forward_tokens_total", 0))),
        ("sessions joined / ended by reason", f"{int(metrics['teacher_sessions_joined_total'])} / {ended}"),
        ("teacher RSS min / max", f"{_mib(min(rss))} / {_mib(max(rss))}"),
        ("teacher RSS max, first / last quarter", f"{_mib(first)} / {_mib(last)}"),
        ("teacher threads: before / at the end", f"{threads_at_start} / {threads_at_end}"),
        ("teacher threads at the end", ", ".join(thread_names)),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n" + "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows))

    assert not failures, "\n\n".join(failures)
    assert server_rc == 0, server.log[-3000:]
    assert figures["leaves"] > 0 and figures["kills"] > 0
    assert metrics["teacher_sessions_joined_total"] == sum(ended.values()), (metrics, ended)
    assert metrics["teacher_sessions_connected"] == 0
    assert last <= first + max(RSS_MARGIN_BYTES, RSS_MARGIN_FRACTION * first), (
        f"teacher RSS grew from {_mib(first)} (first quarter) to {_mib(last)} (last quarter)")
    # Pools created on first use stay (grpc's event engine, gloo's loops, the HTTP workers);
    # a thread left behind per session would exceed this after a few dozen sessions.
    assert threads_at_end <= threads_at_start + THREAD_MARGIN, (threads_at_start, threads_at_end, thread_names)
