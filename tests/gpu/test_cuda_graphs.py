"""--cuda-graphs: the decoder replayed from CUDA graphs gives the eager forward's outputs.

The runner tests need one GPU; the end-to-end test two (a teacher on GPU 0, a student on GPU 1).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from teacher_server.launcher import ServerProcess
from teacher_server.model_runner import ModelRunner
from tests.helpers import build_tiny_model, finish_student, start_student

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def pinned_batch(vocab: int, rows: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed)).pin_memory()
    return ids, torch.ones_like(ids).pin_memory()


@pytest.fixture(scope="module")
def runners():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield ModelRunner("builtin:tiny", "cuda:0", "float32"), ModelRunner("builtin:tiny", "cuda:0", "float32",
                                                                        cuda_graphs=2)
    torch.backends.cuda.matmul.allow_tf32 = tf32


def reserved_growth_after_stream_frees(blocks: int = 8, size: int = 256 << 20) -> int:
    """Bytes the allocator reserves for `blocks` allocations, each freed after use on another
    stream (as every NCCL send's tensors are): about one block when it reuses them."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for _ in range(blocks):
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        block.record_stream(side)
        del block
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before


def test_replays_equal_the_eager_forward_on_new_inputs(runners):
    eager, graphed = runners
    vocab = eager.info.vocab_size
    for seed, (rows, seq) in enumerate([(1, 37), (1, 37), (3, 64), (3, 64), (1, 37), (3, 64), (3, 64)]):
        ids, mask = pinned_batch(vocab, rows, seq, seed)
        want = eager.forward(ids, mask, hidden=False).logits
        got = graphed.forward(ids, mask, hidden=False).logits
        # Each seed is new ids: a replay that read a stale input would differ by far more.
        assert (got - want).abs().max().item() <= 1e-5, (rows, seq, seed)
    assert graphed.graphs.shapes == 2 and not graphed.graphs.off


def test_logits_of_one_replay_survive_the_next(runners):
    """The head writes each forward's logits into a tensor of its own (they are sent while
    the next forward runs), not into a graph's static buffer."""
    eager, graphed = runners
    vocab = eager.info.vocab_size
    batches = [pinned_batch(vocab, 3, 64, 100 + i) for i in range(3)]
    outs = [graphed.forward(ids, mask, hidden=False).logits for ids, mask in batches]
    for (ids, mask), got in zip(batches, outs):
        assert (got - eager.forward(ids, mask, hidden=False).logits).abs().max().item() <= 1e-5


def test_padding_hidden_states_and_shapes_past_the_cap_run_eagerly(runners):
    eager, _ = runners
    graphed = ModelRunner("builtin:tiny", "cuda:0", "float32", cuda_graphs=1)
    vocab = eager.info.vocab_size

    def check(ids, mask, hidden):
        want = eager.forward(ids, mask, hidden=hidden)
        got = graphed.forward(ids, mask, hidden=hidden)
        valid = mask.to(want.logits.device).bool()
        assert (got.logits - want.logits)[valid].abs().max().item() <= 1e-5
        if hidden:
            assert (got.hidden_states[-1] - want.hidden_states[-1])[valid].abs().max().item() <= 1e-5

    for seed in range(3):
        check(*pinned_batch(vocab, 1, 16, seed), hidden=False)
    assert graphed.graphs.shapes == 1
    ids, mask = pinned_batch(vocab, 2, 50, 7)
    padded = mask.clone()
    padded[1, 30:] = 0
    for _ in range(2):
        check(ids, padded, hidden=False)  # padding: a mask transformers checks on the host
        check(ids, mask, hidden=True)  # hidden states: not what the graphs return
        check(*pinned_batch(vocab, 4, 20, 8), hidden=False)  # a second shape, past the cap of 1
    assert graphed.graphs.shapes == 1 and not graphed.graphs.off


def test_a_model_that_syncs_in_its_forward_falls_back_to_eager():
    """A decoder that reads a value back to the host (as some routers do) cannot be
    captured: graphs turn off with the reason, and every forward still comes out right."""
    runner = ModelRunner("builtin:tiny", "cuda:0", "float32", cuda_graphs=4)
    reference = ModelRunner("builtin:tiny", "cuda:0", "float32")

    def read_back(module, args, output):
        (output[0] if isinstance(output, tuple) else output).sum().item()  # a device-to-host read

    runner.model.get_decoder().layers[0].register_forward_hook(read_back)
    vocab = runner.info.vocab_size
    for seed in range(3):
        ids, mask = pinned_batch(vocab, 2, 33, seed)
        got = runner.forward(ids, mask, hidden=False).logits
        assert (got - reference.forward(ids, mask, hidden=False).logits).abs().max().item() <= 1e-5
    assert runner.graphs.shapes == 0
    assert "capturing a forward of 2 x 33 failed" in runner.graphs.off
    # The failed capture is over for the allocator too: it reuses memory freed on other
    # streams (left thinking a capture runs, it reserved all 8 blocks, for good).
    assert reserved_growth_after_stream_frees() <= 2 * (256 << 20)
    # ... and for the device's random generator: random ops still run, from the same state.
    state = torch.cuda.get_rng_state(0)
    first = torch.randn(8, device="cuda:0")
    torch.cuda.set_rng_state(state, 0)
    assert torch.equal(torch.randn(8, device="cuda:0"), first)


def serve_one_student(tmp_path, device: str, batches: int) -> tuple[dict, dict]:
    """A graphed teacher on GPU 0 and one student on `device`; the student's report and /v1/status's cuda_graphs."""
    model_dir = build_tiny_model(tmp_path / "model")
    server = ServerProcess("--model", str(model_dir), "--device", "cuda:0", "--max-batch-tokens", "4096",
                           "--max-seq-len", "512", "--cuda-graphs", "8")
    try:
        out = tmp_path / "student.json"
        # Equal shapes (no padding) and no hidden states: the forwards the graphs serve.
        student = start_student(server.address, model_dir, out, "--device", device, "--batches", str(batches),
                                "--inflight", "4", "--shape", "2x64", "--no-padding", "--topk", "8",
                                "--hidden-layers", "")
        report = finish_student(student, out)
        with urllib.request.urlopen(f"{server.http}/v1/status", timeout=10) as response:
            graphs = json.load(response)["cuda_graphs"]
    finally:
        assert server.stop() == 0, server.log
    assert report["received"] == list(range(batches)), report
    assert all(diff <= 1e-4 for diff in report["worst"].values()), report
    assert graphs["shapes"] >= 1 and not graphs["off"], graphs
    return report, graphs


def test_a_graphed_teacher_serves_a_cpu_student_exact_outputs(tmp_path):
    report, _ = serve_one_student(tmp_path, "cpu", 16)
    assert report["backend"] == "gloo"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_graphed_teacher_serves_exact_outputs_over_nccl(tmp_path):
    report, _ = serve_one_student(tmp_path, "cuda:1", 24)
    assert report["backend"] == "nccl"
