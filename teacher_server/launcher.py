"""`python -m teacher_server` in a child process: started, waited for, stopped.

One launcher for everything that runs a server of its own: the tests, the demo and
the benches. The server is ready once it prints its READY line (teacher_server/app.py),
which names the ports it bound, so callers can ask for port 0 and learn the real ones.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

# The line the server prints once it serves gRPC and HTTP (teacher_server/app.py).
READY = re.compile(r"READY grpc=(\d+) http=(\d+)")
# The directory that holds this package: a checkout's root, or site-packages.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class ServerStartError(RuntimeError):
    """The server exited, or did not print READY in time. `exit_code` is None when it timed out."""

    def __init__(self, message: str, exit_code: int | None, log: str):
        super().__init__(message)
        self.exit_code, self.log = exit_code, log


# NVLink multicast stays off on shared GPU hosts (their NVSwitch state is shared between tenants).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off(env) -> None:
    """Sets MULTICAST_OFF in `env` (a dict or os.environ) where the user has not chosen otherwise."""
    for key, value in MULTICAST_OFF.items():
        env.setdefault(key, value)


def child_env(**extra: str) -> dict:
    """The environment of a child program of this project: this package importable, unbuffered.

    NVLink multicast stays off (shared GPU hosts), in children too. `extra` is set last.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    multicast_off(env)
    env.update(extra)
    return env


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
    """Sends `sig` (a graceful stop by default); kills the process if it has not exited within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    return proc.returncode


class ServerProcess:
    """`python -m teacher_server --host 127.0.0.1 ...` started in a child process; ready on return.

    args: the server's other flags (`--model ...`). ports: (grpc, http) to listen on, e.g.
    an earlier server's `ports` to restart it where its clients look for it; default: any
    free ports. module: what to run with `-m` (a test's teacher with a hook of its own). nproc_per_node > 0: under torchrun (`python -m
    torch.distributed.run --standalone --nproc-per-node N`), a tensor-parallel teacher;
    `proc` is then torchrun's agent. env: the child's environment (default `child_env()`).
    The output is kept in `log_lines`, and written to `log_path` as it comes when given.
    A context manager too: stopped when the block ends.
    """

    def __init__(self, *args: str, startup_timeout_s: float = 120.0, env: dict | None = None,
                 nproc_per_node: int = 0, ports: tuple[int, int] = (0, 0), log_path: Path | None = None,
                 module: str = "teacher_server"):
        self.log_lines: list[str] = []
        self.log_path = log_path
        self.grpc_port = self.http_port = 0
        grpc_port, http_port = map(str, ports)
        torchrun = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc_per_node)]
                    if nproc_per_node else [])
        # `-m` puts the working directory first on sys.path: PYTHONSAFEPATH leaves it out, so the
        # server (and torchrun's ranks) import this package from PYTHONPATH, not a checkout that
        # happens to be the working directory.
        child = {**(env or child_env()), "PYTHONSAFEPATH": "1"}
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, *torchrun, "-m", module, "--host", "127.0.0.1", "--port", grpc_port,
             "--http-port", http_port, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child)
        self._ready = threading.Event()
        # The reader both keeps the output (so the pipe never fills) and spots READY.
        self._reader = threading.Thread(target=self._read, name="teacher-server-log", daemon=True)
        self._reader.start()
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        log = open(self.log_path, "w") if self.log_path is not None else None
        try:
            for line in self.proc.stdout:
                self.log_lines.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                match = READY.search(line)
                if match and not self._ready.is_set():
                    self.grpc_port, self.http_port = map(int, match.groups())
                    self._ready.set()
        finally:
            if log is not None:
                log.close()
            self._ready.set()  # EOF: the process is gone; _wait_ready tells the two apart

    def _wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s):
            raise ServerStartError(f"the teacher server did not print READY within {timeout_s:g} s (give it a "
                                   f"longer startup timeout on a slow machine); its output:\n{self.log}", None,
                                   self.log)
        if not self.grpc_port or self.proc.poll() is not None:
            code = self.proc.wait(10)
            self._reader.join(5)
            raise ServerStartError(f"the teacher server exited with code {code} before it was ready; its output:\n"
                                   f"{self.log}", code, self.log)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def ports(self) -> tuple[int, int]:
        return self.grpc_port, self.http_port

    def rank_pids(self) -> dict[int, int]:
        """Under torchrun: the process id of each rank (the agent's children, by their RANK). Linux only."""
        pids = {}
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # exited meanwhile
                continue
            ranks = [int(v[len(b"RANK="):]) for v in environ if v.startswith(b"RANK=")]
            if ranks:
                pids[ranks[0]] = pid
        return pids

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Stops the server (SIGTERM: a graceful shutdown; killed after `timeout_s`); its exit code."""
        code = stop_process(self.proc, sig, timeout_s)
        self._reader.join(5)
        return code


def metrics_samples(http: str, timeout_s: float = 10.0) -> dict:
    """A server's /metrics as {(name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
