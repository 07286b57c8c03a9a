"""On one GPU, with the teacher's memory really running out: a pack too large for it is served
batch by batch, and top-k of the whole vocabulary that runs out of memory while deriving
(issue 13's third attack) fails that batch alone. Students on the CPU (gloo).

The teacher serves builtin:wide (a Llama-3-sized vocabulary, 128256, on a one-layer body) in
bfloat16. This test process takes all of the GPU's free memory but BUDGET_GIB once the teacher
is up, so the teacher can hold the logits of one 1 x 4096 batch (1.0 GiB) but not of a pack
of four (4.2 GiB), nor top-k of the whole vocabulary of one batch (values 1.0 GiB and int64
indices 4.2 GiB).

    bash bench/run_gpu.sh isolation   # or: python3 -m pytest -q -s -m gpu tests/gpu/test_isolation_gpu.py
"""

from __future__ import annotations

import re
import time

import pytest
import requests
import torch

from distill_common.models import builtin_model
from student_trainer import TeacherClient, TopK
from student_trainer.errors import TeacherError
from teacher_server.launcher import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 128256
SEQ = 4096
BUDGET_GIB = 3.0
K = 8


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--model", "builtin:wide", "--device", "cuda:0", "--dtype", "bfloat16",
                           "--max-batch-tokens", str(4 * SEQ), "--max-seq-len", str(SEQ), "--max-topk", "0",
                           "--max-output-bytes", "64GiB", "--heartbeat-interval-s", "0.5")
    yield server
    assert server.stop() == 0, server.log[-3000:]


@pytest.fixture(scope="module")
def scarce_memory(server):
    """All the GPU's free memory but BUDGET_GIB, held by this process while the tests run."""
    free, _ = torch.cuda.mem_get_info(0)
    hog = torch.empty(free - int(BUDGET_GIB * (1 << 30)), dtype=torch.uint8, device="cuda:0")
    print(f"teacher's room: {torch.cuda.mem_get_info(0)[0] / (1 << 30):.2f} GiB free on the GPU")
    yield
    del hog
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference():
    # The teacher's weights (seeded, rounded to bfloat16), computed on the CPU in float32.
    return builtin_model("wide", torch.bfloat16).float().eval()


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))


def check_topk(reference, ids: torch.Tensor, out) -> None:
    with torch.no_grad():
        expected = torch.topk(torch.log_softmax(reference(input_ids=ids).logits.float(), -1), K, dim=-1).values
    # bfloat16 on two devices: the values agree to its precision (the indices may swap near-ties).
    assert torch.allclose(out.topk_values.float(), expected, atol=0.05, rtol=0.02), (
        (out.topk_values.float() - expected).abs().max())


def test_a_pack_too_large_for_memory_is_served_batch_by_batch(server, scarce_memory, reference):
    clients = [TeacherClient(server.address, "cpu", outputs=(TopK(K),), job_id=f"job{i}") for i in range(4)]
    try:
        sessions = [c.session_id for c in clients]
        started = time.monotonic()
        # The first batch runs alone; the others queue behind it and are packed four to a forward.
        futures = [(seed, clients[seed % 4].submit(batch(seed))) for seed in range(8)]
        outputs = {seed: future.result(timeout=180) for seed, future in futures}
        print(f"8 batches of 1 x {SEQ} served in {time.monotonic() - started:.1f} s")
        assert [c.session_id for c in clients] == sessions and all(c.reconnects == 0 for c in clients)
    finally:
        for c in clients:
            c.close(timeout_s=10)
    packs = [int(n) for n in re.findall(r"\((\d+) batches\) failed \(OutOfMemoryError", server.log)]
    assert packs and max(packs) >= 2, server.log[-5000:]
    for seed in (0, 7):
        check_topk(reference, batch(seed), outputs[seed])
    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200


def test_top_k_of_the_whole_vocabulary_running_out_of_memory_fails_that_batch_alone(server, scarce_memory,
                                                                                      reference):
    with TeacherClient(server.address, "cpu", outputs=(TopK(VOCAB),), job_id="greedy", max_resubmits=0) as greedy, \
            TeacherClient(server.address, "cpu", outputs=(TopK(K),), job_id="modest") as modest:
        session = modest.session_id
        doomed = greedy.submit(batch(100))
        served = [modest.submit(batch(seed)) for seed in (101, 102)]
        with pytest.raises(TeacherError) as failed:
            doomed.result(timeout=120)
        print(f"the greedy batch failed with: {failed.value}")
        assert "OutOfMemoryError" in str(failed.value) and "deriving its outputs" in str(failed.value)
        check_topk(reference, batch(101), served[0].result(timeout=120))
        served[1].result(timeout=120)
        again = modest.submit(batch(103)).result(timeout=120)  # and on
        check_topk(reference, batch(103), again)
        assert modest.session_id == session and modest.reconnects == 0
    assert requests.get(f"{server.http}/healthz", timeout=10).status_code == 200
