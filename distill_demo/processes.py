"""The demo's child processes: one teacher server and the trainer runs, each with a deadline.

Every child writes its output to a log file in the output directory; when one fails,
the error quotes the end of that log. Whatever was started is stopped on the way out
(normal end, error or Ctrl-C): the server with SIGTERM then SIGKILL, trainers the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from teacher_server.launcher import ServerProcess, ServerStartError, child_env, stop_process

# How long a child gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 15.0
# Lines of a failed child's log quoted in the error.
TAIL_LINES = 30


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which, and what to look at or change."""


def threads_env(threads: int) -> dict:
    """A child's environment with `threads` CPU threads.

    The children share the machine's cores (a teacher and two students at once on two
    cores), so each gets a fixed share rather than all of them spinning up one thread
    per core and fighting over it.
    """
    # The Rust tokenizer's own thread pool would compete with the training threads.
    return child_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last lines of a child's log, progress-bar redraws (carriage returns) collapsed."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    kept = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    return "\n".join(f"    | {line}" for line in kept[-lines:] if line.strip())


class TeacherProcess:
    """`python -m teacher_server` on a model directory, on free loopback ports.

    A context manager: the server is up (it printed READY) inside the `with`, and
    stopped when the block ends, whichever way it ends.
    """

    def __init__(self, model_dir: Path, log_path: Path, *, startup_timeout_s: float, threads: int):
        self.model_dir, self.log_path = model_dir, log_path
        self.startup_timeout_s, self.threads = startup_timeout_s, threads
        self._server: ServerProcess | None = None

    def __enter__(self) -> TeacherProcess:
        try:
            self._server = ServerProcess("--model", str(self.model_dir), "--grace-period-s", "5",
                                         startup_timeout_s=self.startup_timeout_s, env=threads_env(self.threads),
                                         log_path=self.log_path)
        except ServerStartError as e:
            if e.exit_code is None:
                raise DemoError(f"the teacher server did not print READY within {self.startup_timeout_s:.0f} s "
                                f"(raise --startup-timeout-s on a slow machine); end of {self.log_path}:\n"
                                f"{log_tail(self.log_path)}") from e
            raise DemoError(f"the teacher server exited with code {e.exit_code} before it was ready; "
                            f"end of {self.log_path}:\n{log_tail(self.log_path)}") from e
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return self._server.address

    @property
    def http_port(self) -> int:
        return self._server.http_port

    def check_alive(self) -> None:
        code = self._server.proc.poll()
        if code is not None:
            self._server.stop()  # reaps it and reads the rest of its output into the log
            raise DemoError(f"the teacher server exited with code {code} while students were "
                            f"training; end of {self.log_path}:\n{log_tail(self.log_path)}")

    def status(self, timeout_s: float = 5.0) -> dict:
        """GET /v1/status: the model and every connected session's counters."""
        url = f"{self._server.http}/v1/status"
        request = urllib.request.Request(url)
        # The server and the students take the token from the environment they inherit; so does this.
        if token := os.environ.get("TEACHER_AUTH_TOKEN"):
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                return json.load(reply)
        except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
            raise DemoError(f"the teacher server's status page {url} did not answer within {timeout_s} s: {e}; "
                            f"see {self.log_path}") from e

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(timeout_s=STOP_TIMEOUT_S)


class TrainerRun:
    """One `python -m student_trainer COMMAND ...` process (`train` unless `command` says
    otherwise, e.g. `eagle3`) writing to `run_dir` (its output to `log_path`, by default
    run_dir/train.log).

    `run_dir` is emptied first: the trainer appends to metrics.jsonl, and a previous
    run's lines would otherwise be read as this one's.
    """

    def __init__(self, name: str, run_dir: Path, args: list[str], *, threads: int, log_path: Path | None = None,
                 command: str = "train"):
        self.name, self.run_dir = name, run_dir
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        self.log_path = log_path or run_dir / "train.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.finished: float | None = None
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "student_trainer", command, "--output-dir", str(run_dir), *args],
                stdout=log, stderr=subprocess.STDOUT, env=threads_env(threads))

    def poll(self) -> int | None:
        code = self._proc.poll()
        if code is not None and self.finished is None:
            self.finished = time.monotonic()
        return code

    @property
    def wall_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def metrics(self) -> list[dict]:
        """metrics.jsonl so far (a line being written is skipped)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return records

    def final_eval_ce(self) -> float:
        """Held-out CE at the last step (the trainer evaluates at the final step)."""
        evals = [r["eval_ce"] for r in self.metrics() if "eval_ce" in r]
        if not evals:
            raise DemoError(f"{self.name} finished without a held-out evaluation in {self.run_dir}/metrics.jsonl; "
                            f"end of {self.log_path}:\n{log_tail(self.log_path)}")
        return evals[-1]

    def stop(self) -> None:
        stop_process(self._proc, timeout_s=STOP_TIMEOUT_S)


def wait_all(runs: list[TrainerRun], *, timeout_s: float, on_poll: Callable[[], None] = lambda: None,
             poll_s: float = 1.0) -> None:
    """Waits until every run has exited 0; any failure or the deadline stops them all and raises.

    `on_poll` runs about every `poll_s` seconds (progress, a teacher health check); an
    exception from it stops the runs too.
    """
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [run.poll() for run in runs]
            for run, code in zip(runs, codes):
                if code not in (None, 0):
                    raise DemoError(f"{run.name} failed (exit code {code}); end of {run.log_path}:\n"
                                    f"{log_tail(run.log_path)}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                names = ", ".join(run.name for run, code in zip(runs, codes) if code is None)
                raise DemoError(f"{names} did not finish within {timeout_s:.0f} s (raise --run-timeout-s, or "
                                f"lower the steps); see their train.log")
            on_poll()
            time.sleep(poll_s)
    finally:
        for run in runs:
            run.stop()


def run_command(name: str, run: Callable[[], object]) -> int:
    """A demo command's exit: `run()` with SIGTERM unwinding like Ctrl-C (so the teacher server
    and trainers started so far are stopped), a DemoError or an interrupt as one line on stderr
    and its exit status, and the result's RESULT line (when it has one) printed last."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run()
    except DemoError as e:
        print(f"\n{name} failed: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"\n{name} interrupted; the teacher server and trainers it started are stopped", file=sys.stderr,
              flush=True)
        return 130
    if hasattr(result, "result_line"):
        print(result.result_line(), flush=True)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
