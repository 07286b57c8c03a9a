"""A pool across "hosts": network namespaces with addresses of their own, joined by a bridge.

Replica A is tensor parallel over two hosts under `torchrun --nnodes 2`, as the README starts a
multi-node teacher; replica B, the same teacher (TP = 2), runs on a third host; a student on a
fourth joins the pool,
lands on A, and A's first host is killed (every process in its namespace, SIGKILL) mid-run:
the student moves to B and every batch arrives, equal to the model run locally.

Needs root (network namespaces, a bridge); where they cannot be made, the test says so and
skips. Slow: three teacher processes and a student on this machine's cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from teacher_server.launcher import child_env
from tests.helpers import ROOT, build_tiny_model, wait_until

pytestmark = pytest.mark.slow

PREFIX = f"tsp{os.getpid() % 10000}"  # names of this run's namespaces and links (at most 15 characters)
SUBNET = "10.77.{}.{}"
BRIDGE = f"{PREFIX}br"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Network namespaces host1..hostN on one bridge: host i has address 10.77.X.i (X from the pid)."""

    def __init__(self, count: int):
        self.names = [f"{PREFIX}h{i}" for i in range(1, count + 1)]
        self.third = os.getpid() % 200 + 20
        self.gateway = SUBNET.format(self.third, 254)
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names, start=1):
            _ip("netns", "add", name)
            _ip("link", "add", f"{PREFIX}v{i}", "type", "veth", "peer", "name", f"{PREFIX}p{i}")
            _ip("link", "set", f"{PREFIX}p{i}", "master", BRIDGE)
            _ip("link", "set", f"{PREFIX}p{i}", "up")
            _ip("link", "set", f"{PREFIX}v{i}", "netns", name)
            _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", f"{PREFIX}v{i}")
            _ip("-n", name, "link", "set", f"{PREFIX}v{i}", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def address(self, host: int) -> str:
        return SUBNET.format(self.third, host)

    def run(self, host: int, command: list[str], log) -> subprocess.Popen:
        env = child_env(GLOO_SOCKET_IFNAME=f"{PREFIX}v{host}", NO_PROXY="*", no_proxy="*")
        return subprocess.Popen(["ip", "netns", "exec", self.names[host - 1], *command], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)

    def kill(self, host: int) -> None:
        """Every process of the host, SIGKILL: the host is gone."""
        pids = _ip("netns", "pids", self.names[host - 1], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for host in range(1, len(self.names) + 1):
            self.kill(host)
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", BRIDGE, check=False)


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root: run as root to make hosts of namespaces")
    try:
        made = Hosts(4)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        for i in range(1, 5):
            subprocess.run(["ip", "netns", "del", f"{PREFIX}h{i}"], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {getattr(e, 'stderr', '') or e}")
    yield made
    made.close()


def _ready(http: str) -> bool:
    try:
        return requests.get(f"{http}/readyz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_a_multi_node_replica_and_a_second_replica_on_hosts_of_their_own_a_host_killed(hosts, tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    server = ["--model", str(model_dir), "--device", "cpu", "--port", "50051", "--http-port", "8000",
              "--max-batch-tokens", "256", "--max-seq-len", "64", "--grace-period-s", "5"]
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("a0", "a1", "b", "student")}
    # Replica A: TP = 2 over hosts 1 and 2, exactly as the README's multi-node command.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--master-addr", hosts.address(1),
                "--master-port", "29500", "--nproc-per-node", "1"]
    procs = [hosts.run(1, [*torchrun, "--node-rank", "0", "-m", "teacher_server", *server,
                           "--advertise-host", hosts.address(1)], logs["a0"]),
             hosts.run(2, [*torchrun, "--node-rank", "1", "-m", "teacher_server", *server,
                           "--advertise-host", hosts.address(2)], logs["a1"]),
             # Replica B: the same teacher (TP = 2: a pool's replicas share their layout) on one host.
             hosts.run(4, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "teacher_server", *server, "--advertise-host", hosts.address(4)], logs["b"])]
    student = None
    try:
        replica_a, replica_b = (f"http://{hosts.address(i)}:8000" for i in (1, 4))
        wait_until(lambda: _ready(replica_a) and _ready(replica_b), 240, "both replicas ready")
        assert requests.get(f"{replica_a}/v1/status", timeout=5).json()["tp_size"] == 2
        out = tmp_path / "student.json"
        pool = f"{hosts.address(1)}:50051,{hosts.address(4)}:50051"
        student = hosts.run(3, [sys.executable, str(ROOT / "tests" / "student_proc.py"), "--address", pool,
                                "--model-dir", str(model_dir), "--out", str(out), "--batches", "12",
                                "--inflight", "2", "--pause-s", "0.5", "--hidden-layers", "0,2", "--job-id", "hosts"],
                            logs["student"])
        # The student joins replica A (the pool's first, both empty), then A's first host goes.
        wait_until(lambda: any(s["job_id"] == "hosts" and s["batches_sent"] >= 2
                               for s in requests.get(f"{replica_a}/v1/status", timeout=5).json()["sessions"]),
                   120, "the student served by replica A")
        hosts.kill(1)
        assert student.wait(240) == 0, (tmp_path / "student.log").read_text()
        report = json.loads(out.read_text())
        assert report["received"] == list(range(12)) and report["reconnects"] == 1, report
        for kind, worst in report["worst"].items():
            assert worst <= 1e-4, (kind, worst, report)
        assert requests.get(f"{replica_b}/v1/status", timeout=5).json()["tp_size"] == 2
    finally:
        for proc in [*procs, *([student] if student else [])]:
            if proc.poll() is None:
                proc.kill()
        for log in logs.values():
            log.close()
        time.sleep(0.5)
