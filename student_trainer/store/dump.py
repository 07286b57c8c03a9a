"""`student-trainer dump`: every row of the data, in order, into a store, from a served teacher or
one loaded in this process; a dump started again continues after its last complete shard."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common import wire
from distill_common.outputs import OutputRequest, TeacherFacts
from distill_common.store import StoreMismatch
from student_trainer.rank import set_up_rank
from student_trainer.store.directory import TeacherStore, data_facts, teacher_facts
from student_trainer.store.writer import ShardWriter

log = logging.getLogger(__name__)


@dataclass
class DumpResult:
    rows: int  # rows in the store's dump shards
    rows_written: int  # by this run
    shards_written: int
    seconds: float
    tokens_written: int = 0
    resumed_at_row: int = 0


def dump(cfg) -> DumpResult:
    """`student-trainer dump`: every row of the data, in order, batch by batch, into the store
    (see the module's docstring). Continues after the last complete shard of an earlier dump
    with the same settings; refuses one with other settings."""
    from transformers import AutoTokenizer

    from student_trainer.data import PackedDataset

    _, _, device, _, directory = set_up_rank(cfg.device, cfg.teacher_outputs, 0)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    dataset = PackedDataset(cfg.data, tokenizer, cfg.seq_len, mode=cfg.pack_mode, skip_bad_lines=cfg.skip_bad_lines)
    teacher, model_name, quantization, architecture = _dump_teacher(cfg, device, tokenizer)
    try:
        settings = {"batch_size": cfg.batch_size, "rows_per_shard": cfg.rows_per_shard}
        if fmt.read_manifest(directory) is None:
            TeacherStore.create(directory, teacher.outputs,
                                teacher=teacher_facts(teacher, model_name, architecture, quantization),
                                data=data_facts(dataset, cfg.data), pack_ids=not cfg.raw_ids,
                                zstd_level=cfg.zstd_level, head=teacher.joined, dump=settings)
        store = TeacherStore(directory)
        store.check_data(dataset, cfg.data)
        store.check_teacher(teacher.outputs, model_name)
        stored = store.manifest
        if (stored["dump"] != settings or stored["outputs"]["pack_ids"] != (not cfg.raw_ids)
                or stored["outputs"]["zstd_level"] != cfg.zstd_level):
            raise StoreMismatch(
                f"{directory / fmt.MANIFEST} was dumped with {stored['dump']}, pack_ids "
                f"{stored['outputs']['pack_ids']}, zstd_level {stored['outputs']['zstd_level']}; this dump asks "
                f"{settings}, pack_ids {not cfg.raw_ids}, zstd_level {cfg.zstd_level}: continue it with the same "
                "settings, or dump into a new directory")
        shards = stored["shards"]
        if any("first_row" not in entry for entry in shards):
            raise StoreMismatch(f"{directory} holds rows written through by training: dump into a new directory")
        for number in range(len(store.shards)):  # what a resumed dump continues must be intact
            store.check_whole(number)
        # What a killed dump was writing is not part of the store: its temporary files go (the
        # shard it was filling is written whole again).
        stale = fmt.remove_stale_temporaries(directory)
        if stale:
            log.info("removed %d temporary files a stopped dump left in %s: %s", len(stale), directory,
                     ", ".join(stale))
        start_row = sum(entry["rows"] for entry in shards)
        if start_row:
            log.info("continuing the dump in %s after row %d (%d complete shards)", directory, start_row, len(shards))
        result = dump_rows(teacher, store, dataset.input_ids, dataset.attention_mask, batch_size=cfg.batch_size,
                           rows_per_shard=cfg.rows_per_shard, start_row=start_row, prefetch=cfg.prefetch,
                           timeout_s=cfg.teacher_timeout_s)
        log.info("dumped %d rows (%d tokens) in %d shards to %s in %.1fs", result.rows_written, result.tokens_written,
                 result.shards_written, directory, result.seconds)
        return result
    finally:
        if hasattr(teacher, "close"):
            teacher.close(timeout_s=5)


def dump_rows(teacher, store: TeacherStore, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
              batch_size: int, rows_per_shard: int, start_row: int = 0, prefetch: int = 2,
              timeout_s: float = 600.0) -> DumpResult:
    """Rows `start_row`.. of `input_ids` / `attention_mask` [N, S], in order, `batch_size` at a
    time, from `teacher` (TeacherClient or LocalTeacher) into `store`'s dump shards.

    `prefetch` batches are asked ahead of the one written (a served teacher computes while this
    process writes); each batch's outputs are encoded on their device (ids packed there) and
    handed to the ShardWriter, whose thread waits for their copy to the host and writes them into
    their shard's file at once: the next forward never waits for a write. Shards hold exactly
    `rows_per_shard` rows (the last one the rest), wherever the batches begin."""
    writer = ShardWriter(store, rows_per_shard, dump=True, rows_total=max(0, len(input_ids) - start_row))
    started, tokens = time.perf_counter(), 0
    inflight: list[tuple[int, int, Future]] = []

    def drain(keep: int) -> None:
        nonlocal tokens
        while len(inflight) > keep:
            begin, end, future = inflight.pop(0)
            out = future.result(timeout=timeout_s)
            keys = [fmt.row_key(input_ids[row], attention_mask[row]) for row in range(begin, end)]
            row_tokens = attention_mask[begin:end].sum(1).tolist()
            writer.add(keys, store.request.disassemble(out), row_tokens, first_row=begin)
            tokens += sum(row_tokens)

    try:
        for begin in range(start_row, len(input_ids), batch_size):
            end = min(begin + batch_size, len(input_ids))
            inflight.append((begin, end, teacher.submit(input_ids[begin:end], attention_mask[begin:end])))
            drain(prefetch)
        drain(0)
    except BaseException:
        # The rows of an unfinished shard are not written: a dump started again writes that shard
        # whole, so its shards stay those of an uninterrupted dump.
        writer.close(write_rest=False)
        raise
    writer.close()
    return DumpResult(rows=store.rows, rows_written=writer.rows_written, shards_written=writer.shards_written,
                      seconds=time.perf_counter() - started, tokens_written=tokens, resumed_at_row=start_row)


def _dump_teacher(cfg, device: torch.device, tokenizer):
    """The teacher a dump asks: a TeacherClient to `--teacher`, or `--model` loaded here (LocalTeacher).
    Returns it, the model's name, its quantization ("none" in its dtype) and architecture."""
    kinds = cfg.outputs()
    if cfg.teacher:
        from student_trainer.client import TeacherClient

        client = TeacherClient(
            cfg.teacher, device, outputs=kinds, dtype=cfg.dtype or None, tokenizer=tokenizer,
            max_inflight=cfg.prefetch + 1, job_id=cfg.job_id or f"dump-{Path(cfg.teacher_outputs).name}",
            transfer_timeout_s=cfg.teacher_timeout_s, reconnect_timeout_s=cfg.teacher_reconnect_timeout_s,
            weight=cfg.teacher_weight, refuse_quantized=cfg.refuse_fp8_teacher, max_teacher_kl=cfg.max_teacher_kl, tls_ca=cfg.teacher_tls,
            tls_cert=cfg.teacher_tls_cert or None, tls_key=cfg.teacher_tls_key or None)
        return client, client.info.model_name, str(client.info.quantization), client.info.architecture
    from distill_common.models import load_causal_lm
    from distill_common.vocab import tokenizer_fingerprint
    from student_trainer.local_teacher import LocalTeacher

    model = load_causal_lm(cfg.model, device=device, dtype=wire.parse_output_dtype(cfg.model_dtype)
                           if cfg.model_dtype else None)
    local = LocalTeacher(model, kinds, wire.parse_output_dtype(cfg.dtype) if cfg.dtype else None)
    # A local teacher's facts lack the tokenizer's fingerprint (a server reports it): the store records it.
    facts = local.outputs.teacher
    local.outputs = OutputRequest(local.outputs.kinds, local.outputs.dtype, TeacherFacts(
        **{**facts.__dict__, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}))
    quantization = getattr(model.config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return local, cfg.model, str(method or "none"), type(model).__name__
