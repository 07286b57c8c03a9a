"""Real servers and real student processes for the multi-process tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"READY grpc=(\d+) http=(\d+) store=(\d+)")


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # NVLink multicast stays off on shared GPU hosts, also in children.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.update(extra)
    return env


def build_tiny_model(path: Path, *, vocab_size: int = 384, layers: int = 2, seed: int = 0,
                     dtype: torch.dtype = torch.float32, hidden_size: int = 48) -> Path:
    """A tiny Llama with random weights, saved like any HF model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).to(dtype).save_pretrained(path)
    return path


class ServerProcess:
    """`python -m teacher_server` in a child process; killed on stop.

    nproc_per_node > 0: under torchrun (`python -m torch.distributed.run --standalone
    --nproc-per-node N`), a tensor-parallel teacher; `proc` is then torchrun's agent.
    ports: (grpc, http, store) to listen on, e.g. an earlier server's `ports` to restart it
    where its clients look for it; default: any free ports.
    """

    def __init__(self, *args: str, startup_timeout_s: float = 120.0, env: dict | None = None,
                 nproc_per_node: int = 0, ports: tuple[int, int, int] = (0, 0, 0)):
        self.log_lines: list[str] = []
        grpc_port, http_port, store_port = map(str, ports)
        launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc_per_node)]
                    if nproc_per_node else [])
        self.proc = subprocess.Popen(
            [sys.executable, *launcher, "-m", "teacher_server", "--host", "127.0.0.1", "--port", grpc_port,
             "--http-port", http_port, "--store-port", store_port, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or child_env(), cwd=ROOT)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(startup_timeout_s):
            self.stop()
            raise RuntimeError(f"teacher server did not start within {startup_timeout_s}s:\n{self.log}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"teacher server exited with {self.proc.returncode}:\n{self.log}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log_lines.append(line)
            match = READY.search(line)
            if match:
                self.grpc_port, self.http_port, self.store_port = map(int, match.groups())
                self._ready.set()
        self._ready.set()

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
    def ports(self) -> tuple[int, int, int]:
        return self.grpc_port, self.http_port, self.store_port

    def rank_pids(self) -> dict[int, int]:
        """Under torchrun: the process id of each rank (the agent's children, by their RANK)."""
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
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


def start_student(address: str, model_dir: Path, out: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """tests/student_proc.py in a child process; its report is written to `out` as JSON."""
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "student_proc.py"), "--address", address,
                             "--model-dir", str(model_dir), "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or child_env(),
                            cwd=ROOT)


def wait_for_line(proc: subprocess.Popen, prefix: str) -> str:
    """Reads the child's output up to a line starting with `prefix` (EOF fails)."""
    seen = []
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
        seen.append(line)
    raise AssertionError(f"child exited ({proc.wait()}) before printing {prefix!r}:\n{''.join(seen)}")


def finish_student(proc: subprocess.Popen, out: Path, timeout_s: float = 180.0) -> dict:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise AssertionError(f"student did not finish within {timeout_s}s:\n{output}")
    assert proc.returncode == 0, f"student exited with {proc.returncode}:\n{output}"
    return json.loads(out.read_text())


def metrics_samples(http: str) -> dict:
    """The server's /metrics as {(name, ((label, value), ...)): value}."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(requests.get(f"{http}/metrics", timeout=10).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous, a port nothing listens on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status_sessions(http: str) -> dict[str, dict]:
    """The sessions on the server's /v1/status, by session id."""
    import requests

    sessions = requests.get(f"{http}/v1/status", timeout=10).json()["sessions"]
    return {s["session_id"]: s for s in sessions}


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
