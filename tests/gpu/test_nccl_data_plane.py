"""The data plane's safeguards on CUDA: the per-batch header on the device, an NCCL group formed
on the gRPC-backed rendezvous store, and (two GPUs) a tampering teacher on GPU 0 whose
student on GPU 1 never resolves a future with another batch's outputs.

    bash bench/run_gpu.sh dataplane
"""

from __future__ import annotations

import asyncio
import datetime

import pytest
import torch
import torch.distributed as dist

from distill_common import wire
from distill_common.rendezvous import RendezvousStore, SessionStore
from distill_common.session_group import HEADER_LAYOUT, HeaderMismatch, SessionGroup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
VOCAB = 384


def test_the_header_goes_to_the_device_without_waiting_and_is_checked_off_the_compute_stream():
    """Teacher: `header` is copied from pinned memory on the current stream, behind the work
    queued there, without the host waiting for it. Student: `check_header` reads it on the
    receive stream, not behind the training step's kernels on the current stream."""
    device = torch.device("cuda", 0)
    group = SessionGroup(backend="nccl", rank=1, pg=None, device=device, timeout_s=10.0)
    group._receive_stream = torch.cuda.Stream(device)
    key = wire.batch_key(torch.arange(6).view(2, 3), torch.ones(2, 3, dtype=torch.int64))
    busy = torch.randn(8192, 8192, device=device)
    torch.cuda.synchronize()
    for _ in range(20):  # ~0.2 s of work queued on the current stream
        busy = busy @ busy / 8192
    header = group.header(5, key)
    assert not torch.cuda.current_stream(device).query(), "the header's copy waited for the queued work"
    assert header.device == device and (header.shape, header.dtype) == HEADER_LAYOUT
    torch.cuda.synchronize()
    received = torch.empty(HEADER_LAYOUT[0], dtype=HEADER_LAYOUT[1], device=device)
    received.copy_(header)
    torch.cuda.synchronize()  # as after a receive's completion, which the student waits for first
    for _ in range(20):
        busy = busy @ busy / 8192
    group.check_header(received, 5, key)  # on the receive stream: returns before the queued work is done
    assert not torch.cuda.current_stream(device).query()
    with pytest.raises(HeaderMismatch, match="header: batch 5"):
        group.check_header(received, 6, key)
    torch.cuda.synchronize()


def test_an_nccl_group_forms_on_the_rendezvous_store():
    """NCCL exchanges its unique id on the store, from its own C++ code: on a store implemented
    in Python whose operations reach the teacher's session store (here in-process)."""
    session = SessionStore(timeout_s=30.0)

    def call(request, timeout_s):
        return asyncio.run(session.serve(request))

    store = RendezvousStore(call, "gpu-session", timeout_s=30.0)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=30)
    pg = dist.ProcessGroupNCCL(store, 0, 1, options)
    try:
        tensor = torch.ones(4, device="cuda:0")
        pg.allreduce([tensor]).wait()
        torch.cuda.synchronize()
        assert tensor.tolist() == [1.0] * 4
        assert session.store.num_keys() >= 1, "NCCL's unique id went through the rendezvous store"
    finally:
        pg.abort()
        session.close()


@two_gpus
def test_a_tampering_teacher_on_gpu0_never_gives_the_student_on_gpu1_wrong_outputs(tmp_path):
    from student_trainer import TeacherClient
    from student_trainer.errors import BatchFailed
    from teacher_server.launcher import ServerProcess, child_env
    from tests.helpers import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", vocab_size=VOCAB)
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model_dir).to("cuda:1").eval()
    with ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "4096",
                       "--max-seq-len", "512", module="tests.tampering_teacher",
                       env=child_env(TAMPER_AT="2")) as server:
        for job in ("stale-gpu", "fail-gpu"):
            batches = [torch.randint(0, VOCAB, (2, 64)) for _ in range(6)]
            with TeacherClient(server.address, "cuda:1", job_id=job, max_inflight=2) as teacher:
                assert teacher.backend == "nccl"
                futures = [teacher.submit(ids) for ids in batches]
                results = []
                for future in futures:
                    try:
                        results.append(future.result(timeout=120))
                    except BatchFailed as e:
                        results.append(e)
                reconnects = teacher.reconnects
            for i, (ids, out) in enumerate(zip(batches, results)):
                if job == "fail-gpu" and i == 2:
                    assert isinstance(out, BatchFailed) and "injected" in str(out)
                    continue
                with torch.no_grad():
                    expected = local(ids.to("cuda:1")).logits
                assert (out.logits - expected).abs().max().item() <= 1e-4, (job, i)
            assert reconnects == (1 if job == "stale-gpu" else 0), job
        assert "TAMPERED stale" in server.log and "TAMPERED fail" in server.log
