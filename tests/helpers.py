"""Real servers and real student processes for the multi-process tests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from teacher_server.launcher import child_env

ROOT = Path(__file__).resolve().parent.parent


def build_tiny_model(path: Path, *, vocab_size: int = 384, layers: int = 2, seed: int = 0,
                     dtype: torch.dtype = torch.float32, hidden_size: int = 48, architecture: str = "llama") -> Path:
    """A tiny Llama (or another architecture of the same shape: "mistral") with random weights,
    saved like any HF model directory."""
    import transformers

    name = {"llama": "Llama", "mistral": "Mistral"}[architecture]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    getattr(transformers, f"{name}ForCausalLM")(config).to(dtype).save_pretrained(path)
    return path


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


def run_ok(command: list[str], timeout_s: float) -> str:
    """Runs `command` (from the repository's root, the tests' environment) to its end; its output,
    stdout and stderr together. Fails the test, with the output, if it exits non-zero or runs past
    `timeout_s`."""
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                              cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(command)} did not finish within {timeout_s}s:\n{e.output}") from None
    assert done.returncode == 0, done.stdout
    return done.stdout


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str, beta: float = 0.5) -> torch.Tensor:
    """Per position [...] the divergence of distributions p, q [..., n] (forward_kl, reverse_kl or
    jsd with `beta`), as its formula reads: the reference the losses are tested against."""
    def kl(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a)).sum(-1)

    if kind == "forward_kl":
        return kl(p, q)
    if kind == "reverse_kl":
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


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
