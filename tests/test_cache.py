"""Shared work: identical batches from several sessions cost one forward.

The cache module on its own, then real servers with real student processes: two
students on the same data get exact outputs for one forward's worth of tokens; with
the cache off, the same batch at two times costs two forwards; the LRU stays within
--cache-bytes and evicts the least recently used entry.
"""

from __future__ import annotations

import pytest
import requests
import torch

from distill_common.outputs import BatchOutputs, ForwardNeeds
from student_trainer import HiddenStates, Logits, TeacherClient, TopK
from distill_common.wire import batch_key
from teacher_server.cache import OutputCache
from teacher_server.launcher import ServerProcess, metrics_samples
from tests.helpers import build_tiny_model, finish_student, start_student, wait_for_line

TOLERANCE = 1e-4
VOCAB = 384


def _counter(samples: dict, name: str) -> float:
    return samples.get((name, ()), 0.0)


# ---- the module -----------------------------------------------------------------------------


def test_batch_key_is_a_content_digest():
    ids = torch.arange(12).reshape(3, 4)
    mask = torch.ones(3, 4, dtype=torch.int64)
    assert batch_key(ids, mask) == batch_key(ids.clone(), mask.clone())
    assert batch_key(ids, mask) != batch_key(ids.reshape(4, 3), mask.reshape(4, 3))  # same bytes, other shape
    other_mask = mask.clone()
    other_mask[0, 3] = 0
    assert batch_key(ids, mask) != batch_key(ids, other_mask)
    assert batch_key(ids, mask) != batch_key(ids.to(torch.int32), mask)  # dtype is part of the key
    other_ids = ids.clone()
    other_ids[2, 1] += 1
    assert batch_key(ids, mask) != batch_key(other_ids, mask)
    assert batch_key(ids.t(), mask.t()) == batch_key(ids.t().contiguous(), mask.t().contiguous())
    assert len(batch_key(ids, mask)) == 32


def _outputs(rows: int, layers=(), fill: float = 0.0) -> BatchOutputs:
    return BatchOutputs(torch.full((rows, 4, 10), fill), {layer: torch.full((rows, 4, 6), fill) for layer in layers})


def _layers(*layers: int) -> ForwardNeeds:
    return ForwardNeeds(hidden_layers=frozenset(layers))


def test_lru_within_bytes_and_layers():
    entry = _outputs(1).nbytes  # 1 x 4 x 10 float32 = 160 bytes
    cache = OutputCache(capacity_bytes=2 * entry + entry // 2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert cache.get(a) is None
    cache.put(a, _outputs(1, fill=1.0))
    cache.put(b, _outputs(1, fill=2.0))
    assert cache.get(a).logits[0, 0, 0] == 1.0  # a is now the most recently used
    cache.put(c, _outputs(1, fill=3.0))  # over the bound: b, least recently used, goes
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (3, 3, 1, 2)
    assert stats.bytes == 2 * entry <= stats.capacity_bytes

    # An entry without a layer a session asks for is a miss; a recompute with it replaces it.
    assert cache.get(a, _layers(1)) is None
    cache.put(a, _outputs(1, layers=(0, 1)))
    assert cache.get(a, _layers(1)) is not None and cache.get(a, _layers(0, 1)) is not None
    assert cache.get(a, _layers(2)) is None
    assert cache.stats().bytes <= cache.capacity_bytes

    # An entry larger than the whole cache is served but not kept.
    big = _outputs(4)
    assert cache.put(b"d" * 32, big) is big and cache.get(b"d" * 32) is None
    assert cache.stats().bytes <= cache.capacity_bytes


def test_kept_entries_own_their_memory():
    packed = torch.randn(4, 8, 10)
    cache = OutputCache(capacity_bytes=1 << 20)
    kept = cache.put(b"k" * 32, BatchOutputs(packed[1:3, :5]))
    assert kept.logits.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    assert torch.equal(kept.logits, packed[1:3, :5])
    assert cache.stats().bytes == 2 * 5 * 10 * 4


def test_cache_off_keeps_nothing():
    cache = OutputCache(0)
    out = _outputs(1)
    assert not cache.enabled and cache.put(b"a" * 32, out) is out and cache.get(b"a" * 32) is None
    assert cache.stats().misses == 0 and cache.stats().bytes == 0
    with pytest.raises(ValueError, match="cache capacity"):
        OutputCache(-1)


# ---- real servers, real students --------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _server(model_dir, *flags: str) -> ServerProcess:
    return ServerProcess("--model", str(model_dir), "--max-batch-tokens", "256", "--max-seq-len", "64", *flags)


@pytest.fixture(scope="module")
def cached_server(model_dir):
    server = _server(model_dir, "--cache-bytes", "64MiB")
    yield server
    assert server.stop() == 0, server.log


def test_two_students_on_the_same_data_cost_one_forward(cached_server, model_dir, tmp_path):
    before = metrics_samples(cached_server.http)
    go = tmp_path / "go"
    batches = 6
    # Same seed and shape: the same batches. Different outputs asked: each derives its own.
    common = ["--batches", str(batches), "--inflight", "3", "--seed", "5", "--shape", "2x24",
              "--start-file", str(go)]
    a_out, b_out = tmp_path / "a.json", tmp_path / "b.json"
    a = start_student(cached_server.address, model_dir, a_out, *common, "--topk", "5", "--hidden-layers", "0,2",
                      "--job-id", "sweep-a")
    b = start_student(cached_server.address, model_dir, b_out, *common, "--no-logits", "--topk", "7",
                      "--hidden-layers", "1", "--job-id", "sweep-b")
    wait_for_line(a, "JOINED")
    wait_for_line(b, "JOINED")
    go.touch()  # both joined: every computed entry keeps layers 0, 1 and 2
    a_report, b_report = finish_student(a, a_out), finish_student(b, b_out)
    for report in (a_report, b_report):
        assert report["received"] == list(range(batches))
        for kind, diff in report["worst"].items():
            assert diff <= TOLERANCE, (kind, diff, report)
    assert a_report["tokens"] == b_report["tokens"] == batches * 2 * 24

    after = metrics_samples(cached_server.http)
    delta = {name: _counter(after, name) - _counter(before, name) for name in (
        "teacher_forward_tokens_total", "teacher_cache_hits_total", "teacher_cache_misses_total",
        "teacher_shared_batches_total", "teacher_forward_seconds_count")}
    # One forward's worth of tokens for the pair: each batch computed once (one shape,
    # so packing adds no padding), the other copy served from its rows or from the cache.
    assert delta["teacher_forward_tokens_total"] == a_report["tokens"], delta
    assert delta["teacher_cache_misses_total"] == batches, delta
    assert delta["teacher_cache_hits_total"] + delta["teacher_shared_batches_total"] == batches, delta
    assert delta["teacher_forward_seconds_count"] <= batches, delta
    status = requests.get(f"{cached_server.http}/v1/status", timeout=10).json()["cache"]
    assert status["hits"] == _counter(after, "teacher_cache_hits_total")
    assert 0 < status["bytes"] <= status["capacity_bytes"] == 64 << 20


def test_a_layer_the_entry_lacks_is_a_miss(cached_server, reference):
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = reference(input_ids=ids, output_hidden_states=True)
    before = metrics_samples(cached_server.http)
    with TeacherClient(cached_server.address, "cpu", outputs=(Logits(), HiddenStates((0,))), job_id="layers-a") as a:
        first = a.submit(ids).result(timeout=60)
    # Alone when it ran, a's forward kept layer 0 only: b's layer 1 needs a forward.
    with TeacherClient(cached_server.address, "cpu", outputs=(TopK(4), HiddenStates((1,))),
                       job_id="layers-b") as b:
        second = b.submit(ids).result(timeout=60)
        third = b.submit(ids).result(timeout=60)  # now kept with layer 1: a hit
    after = metrics_samples(cached_server.http)
    delta = {name: _counter(after, name) - _counter(before, name)
             for name in ("teacher_cache_hits_total", "teacher_cache_misses_total", "teacher_forward_tokens_total")}
    assert delta == {"teacher_cache_hits_total": 1, "teacher_cache_misses_total": 2,
                     "teacher_forward_tokens_total": 2 * ids.numel()}, delta
    assert (first.logits - ref.logits).abs().max() <= TOLERANCE
    assert (first.hidden_states[0] - ref.hidden_states[0]).abs().max() <= TOLERANCE
    for out in (second, third):
        assert (out.hidden_states[1] - ref.hidden_states[1]).abs().max() <= TOLERANCE
        assert (out.topk_values - torch.log_softmax(ref.logits, -1).topk(4, dim=-1).values).abs().max() <= TOLERANCE
    assert torch.equal(second.topk_indices, third.topk_indices)


def test_without_the_cache_the_same_batch_later_costs_a_second_forward(model_dir, reference):
    server = _server(model_dir)
    try:
        ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = reference(input_ids=ids).logits
        with TeacherClient(server.address, "cpu", job_id="off-a") as a, \
                TeacherClient(server.address, "cpu", job_id="off-b") as b:
            first = a.submit(ids).result(timeout=60)
            second = b.submit(ids).result(timeout=60)  # at a different time: nothing kept
        samples = metrics_samples(server.http)
        assert _counter(samples, "teacher_forward_tokens_total") == 2 * ids.numel()
        assert _counter(samples, "teacher_forward_seconds_count") == 2
        assert _counter(samples, "teacher_cache_hits_total") == 0
        assert _counter(samples, "teacher_cache_misses_total") == 0  # off: nothing looked up
        assert _counter(samples, "teacher_cache_capacity_bytes") == 0
        for out in (first, second):
            assert (out.logits - ref).abs().max() <= TOLERANCE
    finally:
        assert server.stop() == 0, server.log


def test_lru_evicts_within_cache_bytes(model_dir, reference):
    shape = (1, 16)
    entry_bytes = shape[0] * shape[1] * VOCAB * 4  # float32 logits, no hidden states asked
    bound = entry_bytes * 5 // 2  # room for two entries
    server = _server(model_dir, "--cache-bytes", str(bound))
    try:
        generator = torch.Generator().manual_seed(7)
        x0, x1, x2 = (torch.randint(0, VOCAB, shape, generator=generator) for _ in range(3))
        seen_bytes = []

        def stats() -> dict:
            samples = metrics_samples(server.http)
            seen_bytes.append(_counter(samples, "teacher_cache_bytes"))
            return {name: _counter(samples, f"teacher_cache_{name}")
                    for name in ("hits_total", "misses_total", "evictions_total", "entries", "bytes")}

        with TeacherClient(server.address, "cpu", job_id="lru") as teacher:
            def run(ids):
                out = teacher.submit(ids).result(timeout=60)
                return out.logits

            computed = {name: run(ids) for name, ids in (("x0", x0), ("x1", x1), ("x2", x2))}
            assert stats() == {"hits_total": 0, "misses_total": 3, "evictions_total": 1, "entries": 2,
                               "bytes": 2 * entry_bytes}  # x0 went
            assert torch.equal(run(x2), computed["x2"])  # a hit, same values
            assert stats()["hits_total"] == 1
            run(x0)  # evicted before: computed again, and x1 (least recently used) goes
            assert stats() == {"hits_total": 1, "misses_total": 4, "evictions_total": 2, "entries": 2,
                               "bytes": 2 * entry_bytes}
            run(x2)  # still there
            assert stats()["hits_total"] == 2
            run(x1)  # x1 was the one evicted
            assert stats()["misses_total"] == 5
            for name, ids in (("x0", x0), ("x1", x1), ("x2", x2)):
                with torch.no_grad():
                    assert (computed[name] - reference(input_ids=ids).logits).abs().max() <= TOLERANCE
        assert max(seen_bytes) <= bound
        status = requests.get(f"{server.http}/v1/status", timeout=10).json()["cache"]
        assert status["capacity_bytes"] == bound and status["bytes"] <= bound and status["evictions"] == 3
    finally:
        assert server.stop() == 0, server.log
