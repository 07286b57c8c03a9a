"""bench/store_throughput.py at a tiny shape on CPU: the GPU bench's code runs (bytes per token of every
stored kind, the dump's own loop against the forward alone, a trainer's reads)."""

from __future__ import annotations

import json


def test_the_store_bench_runs_at_a_tiny_shape(tmp_path):
    from bench.store_throughput import main

    out = tmp_path / "store.md"
    assert main(["--tiny", "--batches", "2", "--out", str(out)]) == 0
    figures = json.loads(out.with_suffix(".json").read_text())
    sizes = {(row["shape"], row["kind"]): row["bytes_per_token"] for row in figures["bytes_per_token"]}
    # Top-64 of a 128,256-token vocabulary: 64 bf16 values and 64 ids of 17 bits a token, a 32-byte key and a 32-byte digest a row.
    assert sizes[("llama3-8b", "top-64")] == 64 * 2 + 64 * 17 / 8 + 64 / 4096
    assert sizes[("llama3-8b", "top-64, int32 ids")] == 64 * (2 + 4) + 64 / 4096
    assert sizes[("llama3-8b", "final hidden state (+ head once)")] == 4096 * 2 + 64 / 4096
    assert sizes[("demo", "logits")] == 1024 * 4 + 64 / 128
    measured = {row["kind"]: row for row in figures["measured"]}
    assert set(measured) == {"top-64", "final hidden state"}
    for row in measured.values():
        assert row["tokens"] == 2 * 2 * 32
        assert row["dump_tokens_per_s"] > 0 and row["read_tokens_per_s"] > 0 and row["alone_tokens_per_s"] > 0
    # What was written is what the layout says, shard headers aside.
    assert 0 <= measured["top-64"]["disk_bytes_per_token"] - sizes[("tiny", "top-64")] < 8
    assert "| top-64 |" in out.read_text()
