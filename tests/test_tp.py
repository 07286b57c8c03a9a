"""A tensor-parallel teacher on CPU: two ranks under torchrun (gloo), a real student process.

The student runs the same model locally in float32 on every batch and reports the worst
difference per output kind, so "equal to the model run locally" is "equal to TP=1".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import requests

from student_trainer import AttentionInputs, TeacherClient, TeacherError
from teacher_server.admin import AdminConfig, query
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import ROOT, build_tiny_model, finish_student, free_port, start_student, wait_until

TOLERANCE = 1e-4
SERVER_ARGS = ("--max-batch-tokens", "256", "--max-seq-len", "64", "--grace-period-s", "10")


def _student_matches_local_model(server: ServerProcess, reference_dir, out, *args: str) -> dict:
    # Logits, top-k, the hidden states of every layer, the final hidden state and the output head
    # (gathered whole from the ranks' shards): each output kind a TP teacher gives.
    report = finish_student(start_student(server.address, reference_dir, out, "--batches", "6", "--inflight", "3",
                                          "--topk", "5", "--hidden-layers", "0,1,2", "--final-hidden", *args), out)
    assert report["received"] == list(range(6)), report
    for kind, diff in report["worst"].items():
        assert diff <= TOLERANCE, (kind, diff, report)
    return report


def test_tp2_saved_model_equals_tp1_and_sigterm_to_torchrun_stops_every_rank(tmp_path):
    """A saved model: transformers' own TP plan. SIGTERM to torchrun's agent, as Kubernetes sends it."""
    model_dir = build_tiny_model(tmp_path / "model")
    server = ServerProcess("--model", str(model_dir), *SERVER_ARGS, nproc_per_node=2)
    try:
        assert "with transformers' plan" in server.log, server.log
        assert len(server.rank_pids()) == 2
        _student_matches_local_model(server, model_dir, tmp_path / "a.json")
        # Only the final hidden state: every rank runs the decoder without the head's gather.
        _student_matches_local_model(server, model_dir, tmp_path / "c.json", "--no-logits", "--topk", "0",
                                     "--hidden-layers", "")
        with pytest.raises(TeacherError, match="tensor parallel over 2 ranks, and attention inputs are captured on "
                                               "one process"):
            TeacherClient(server.address, "cpu", outputs=(AttentionInputs((0,)),))
        status = requests.get(f"{server.http}/v1/status", timeout=10).json()
        assert status["vocab_size"] == 384 and status["num_layers"] == 2  # the full vocabulary, not a shard
        assert status["tp_size"] == 2
        info = query("info", server.address, AdminConfig())  # what `teacher-server info` prints
        assert re.search(r"^tensor parallel +2$", info, re.MULTILINE), info
    finally:
        server.stop()  # SIGTERM to the agent, which passes it to both ranks
    # torchrun's agent itself ends with its SignalException; the ranks say how they ended.
    assert "teacher stopped" in server.log and "tensor-parallel rank 1 stopped" in server.log, server.log
    assert "Traceback" not in server.log.split("Received 15 death signal")[0], server.log


@pytest.mark.slow  # a second TP=2 teacher; the saved model's (default suite) runs the same sharding
def test_tp2_model_built_from_config_equals_tp1_and_sigterm_to_rank0_exits_0(tmp_path):
    """builtin:tiny: built from a config, sharded by torch's parallelize_module."""
    from distill_common.models import builtin_model

    reference_dir = tmp_path / "reference"
    builtin_model("tiny").save_pretrained(reference_dir)  # the same seeded weights, for the student's local run
    server = ServerProcess("--model", "builtin:tiny", *SERVER_ARGS, nproc_per_node=2)
    try:
        assert "torch's parallelize_module" in server.log, server.log
        _student_matches_local_model(server, reference_dir, tmp_path / "b.json", "--max-len", "60")
        os.kill(server.rank_pids()[0], signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log  # torchrun's exit status: every rank exited 0
    finally:
        server.stop()
    assert "tensor-parallel rank 1 stopped" in server.log, server.log


def test_a_size_that_does_not_divide_the_heads_is_refused_with_the_sizes_that_do():
    from distill_common.models import model_config
    from teacher_server.parallel import check_heads

    config = model_config("builtin:tiny", False)  # 4 attention heads, 2 key/value heads
    for size in (1, 2):
        check_heads(config, size)
    with pytest.raises(ValueError, match=r"tensor parallelism over 3 ranks needs the attention heads \(4\) and "
                                         r"key/value heads \(2\) divisible by 3: run 1 or 2 ranks in all"):
        check_heads(config, 3)


@pytest.mark.slow  # three ranks and torchrun's agent, each importing torch, to see the same refusal from the CLI
def test_heads_not_divisible_by_the_world_size_are_refused():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "-m", "teacher_server", "--model", "builtin:tiny", "--port", "0", "--http-port", "0"],
                          capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT)
    assert proc.returncode != 0
    assert ("tensor parallelism over 3 ranks needs the attention heads (4) and key/value heads (2) divisible by 3: "
            "run 1 or 2 ranks") in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# The follower's death in the default suite; rank 0's (the same keep-alive, seen from the other side) under slow.
@pytest.mark.parametrize("dies", ["follower", pytest.param("rank0", marks=pytest.mark.slow)])
def test_a_dead_rank_ends_the_others_instead_of_hanging(dies):
    """Ranks started by hand (no torchrun agent to clean up): each notices the other's death."""
    world = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = ("--model", "builtin:tiny", "--tp-timeout-s", "8")
    follower = subprocess.Popen([sys.executable, "-m", "teacher_server", "--host", "127.0.0.1", "--port", "0",
                                 "--http-port", "0", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=child_env(RANK="1", LOCAL_RANK="1", **world))
    try:
        server = ServerProcess(*args, env=child_env(RANK="0", LOCAL_RANK="0", **world))
    except BaseException:
        follower.kill()
        raise
    try:
        assert requests.get(f"{server.http}/readyz", timeout=10).status_code == 200
        if dies == "follower":
            follower.kill()
            # A keep-alive (every --tp-timeout-s / 4 when idle) finds the closed connection;
            # rank 0 then shuts down as on SIGTERM (/readyz 503) and exits non-zero.
            wait_until(lambda: server.proc.poll() is not None, 30, "rank 0 to exit after its follower died")
            assert server.proc.returncode == 1, server.log
            assert "tensor-parallel world broken" in server.log, server.log
        else:
            server.proc.kill()
            output, _ = follower.communicate(timeout=30)
            assert follower.returncode == 1, output
            assert "no message from rank 0" in output, output
    finally:
        server.stop()
        if follower.poll() is None:
            follower.kill()
        follower.wait(10)


def _shard_styles_rank(rank: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from teacher_server.parallel import ColwiseShard, RowwiseShard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same whole layers on both ranks
    up, down, head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 7)  # 7: not divisible by 2
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        want_hidden = down(up(x))
        want_logits = head(want_hidden)
        parallelize_module(up, mesh, ColwiseShard())
        parallelize_module(down, mesh, RowwiseShard())
        parallelize_module(head, mesh, ColwiseShard(gather=True))
        assert up.weight.shape == (4, 6) and down.weight.shape == (6, 4) and head.weight.shape == (4, 6)
        hidden = down(up(x))
        logits = head(hidden)
    assert head.out_features == 7 and logits.shape == (3, 5, 7)
    assert (hidden - want_hidden).abs().max() <= 1e-5, (hidden - want_hidden).abs().max()
    assert (logits - want_logits).abs().max() <= 1e-5, (logits - want_logits).abs().max()
    dist.destroy_process_group()


def test_shard_styles_equal_the_whole_layers_with_bias_and_an_uneven_vocabulary(tmp_path):
    """The plan's plain-tensor styles on two real gloo ranks: column-wise (split and gathered,
    7 outputs over 2 ranks) and row-wise (all-reduced, the bias added once)."""
    import torch.multiprocessing as mp

    mp.start_processes(_shard_styles_rank, args=(str(tmp_path / "init"),), nprocs=2, start_method="spawn",
                       join=True)
