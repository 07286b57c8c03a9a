"""One store directory: its manifest read and checked against a run, its shards written
(atomically, then named in the manifest). Its shard files and head, opened, checked, indexed
and read row by row (each row checked against its digest), are student_trainer/store/files.py's.

A store is input from whoever wrote the directory: the manifest's fields are checked for their
type before use, and its teacher facts are bounded (`fmt.check_facts`) before any shape is
derived from them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common import wire
from distill_common.outputs import (FinalHidden, JoinData, Output, OutputRequest, SubsetLogits, TeacherFacts,
                                    output_spec)
from distill_common.store import StoreCorrupt, StoreError, StoreMismatch, StoreMissing
from student_trainer.link import TeacherInfo
from student_trainer.store.files import ShardFiles, stored_spec
from student_trainer.store.timing import StageTimes, stage


def data_facts(dataset, data_path: str | Path) -> dict:
    """What the manifest records of the data a store's rows come from."""
    return {"file": str(data_path), "sha256": fmt.sha256_of(Path(data_path)), "fingerprint": dataset.fingerprint,
            "rows": len(dataset), "seq_len": dataset.seq_len, "pack_mode": dataset.mode}


def teacher_facts(source, model_name: str, architecture: str = "", quantization: str = "") -> dict:
    """What the manifest records of the teacher: its model, dtype, quantization ("" when it does
    not report one) and what its outputs' shapes depend on (TeacherFacts)."""
    facts = source.outputs.teacher
    return {"model": model_name, "architecture": architecture, "dtype": wire.dtype_name(facts.dtype),
            "quantization": quantization, "tokenizer_fingerprint": facts.tokenizer_fingerprint,
            "facts": fmt.facts_to_json(facts)}


# ---- one store directory -------------------------------------------------------------------------


class TeacherStore:
    """A store directory: its manifest, its index, its rows (see the module's docstring)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        manifest = fmt.read_manifest(self.directory)
        if manifest is None:
            raise StoreMissing(f"{self.directory / fmt.MANIFEST} does not exist: dump the teacher's outputs first "
                               "(student-trainer dump --teacher-outputs DIR ...), or give --teacher too to fill the "
                               "store while training")
        self.manifest = manifest
        self.manifest_path = self.directory / fmt.MANIFEST
        try:
            outputs = manifest["outputs"]
            self.facts: TeacherFacts = fmt.facts_from_json(manifest["teacher"]["facts"])
            self.seq_len = manifest["data"]["seq_len"]
            if type(self.seq_len) is not int:
                raise TypeError(f"data.seq_len is {self.seq_len!r}, not a whole number")
            fmt.check_facts(self.facts, self.seq_len, self.manifest_path)  # before any shape is derived from them
            spec = fmt.spec_from_json(outputs["spec"])
            self.request = OutputRequest.resolve(spec, self.facts)
            self.codecs = fmt.codecs_for(self.request, self.seq_len, pack=outputs["pack_ids"],
                                         zstd_level=int(outputs["zstd_level"]))
            if not isinstance(manifest["shards"], list):
                raise TypeError("shards is not a list")
        except StoreError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreCorrupt(f"{self.directory / fmt.MANIFEST}: malformed ({type(e).__name__}: {e})") from e
        if [codec.to_json() for codec in self.codecs] != outputs["tensors"]:
            raise StoreCorrupt(f"{self.directory / fmt.MANIFEST}: its tensors {outputs['tensors']} are not what its "
                               f"outputs ({self.request}) store")
        self.files = ShardFiles(self.directory, self.codecs)
        self.times: StageTimes | None = None  # where reads and writes spend their time, when asked (the bench)
        self.head = self.files.read_head(manifest.get("head"), self.request)
        self._manifest_mtime_ns = 0
        self.files.add(manifest["shards"])

    # ---- what the store holds --------------------------------------------------------------

    @property
    def rows(self) -> int:
        return sum(shard.entry["rows"] for shard in self.shards)

    @property
    def shards(self) -> list:
        """The shards opened, in the manifest's order (each one's manifest entry, path and places)."""
        return self.files.shards

    @property
    def row_bytes_read(self) -> int:
        """Bytes of rows read so far (the rows' tensors, zstd frames as stored)."""
        return self.files.row_bytes_read

    @property
    def row_bytes_hashed(self) -> int:
        """Bytes of rows hashed so far to check them against their digests: each byte read, once."""
        return self.files.row_bytes_hashed

    def check_whole(self, number: int) -> None:
        """StoreCorrupt unless shard `number`'s whole file has the sha256 the manifest records (what a
        resumed dump checks of the shards it continues after)."""
        self.files.check_whole(number)

    @property
    def info(self) -> TeacherInfo:
        """What the store says of its teacher, as `TeacherClient.info` says it of a live one (no batch
        limits: a store has none)."""
        teacher = self.manifest["teacher"]
        return TeacherInfo(model_name=teacher["model"], architecture=teacher.get("architecture", ""),
                           vocab_size=self.facts.vocab_size, hidden_size=self.facts.hidden_size,
                           num_layers=self.facts.num_layers, dtype=teacher["dtype"],
                           tokenizer_fingerprint=self.facts.tokenizer_fingerprint, max_batch_tokens=0, max_seq_len=0,
                           quantization=self.facts.quantization)

    def refresh(self) -> None:
        """Takes in the shards written since this store was opened (by another rank, say)."""
        changed = (self.directory / fmt.MANIFEST).stat().st_mtime_ns
        if changed == self._manifest_mtime_ns:
            return
        self._manifest_mtime_ns = changed
        manifest = fmt.read_manifest(self.directory)
        with self.files.lock:
            if manifest is not None and not isinstance(manifest.get("shards"), list):
                raise self.files.malformed("shards is not a list")
            if manifest is not None and len(manifest["shards"]) > len(self.shards):
                self.manifest["shards"] = manifest["shards"]
                self.files.add(manifest["shards"])

    def locate(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        return self.files.locate(keys)

    # ---- checks against what a run asks ----------------------------------------------------

    def check_data(self, dataset, data_path: str | Path) -> None:
        """StoreMismatch naming what differs when `dataset` is not the data the rows come from."""
        stored, manifest_path = self.manifest["data"], self.directory / fmt.MANIFEST
        if stored["fingerprint"] in (None, dataset.fingerprint):
            return  # the same data, or rows from batches of no data file (the HF Trainer's): found by their keys
        differs = []
        if stored["seq_len"] != dataset.seq_len:
            differs.append(f"--seq-len {stored['seq_len']} there, {dataset.seq_len} here")
        if stored["pack_mode"] != dataset.mode:
            differs.append(f"--pack-mode {stored['pack_mode']} there, {dataset.mode} here")
        digest = fmt.sha256_of(Path(data_path))
        if stored["sha256"] != digest:
            differs.append(f"the data file: {stored['file']} (sha256 {stored['sha256'][:12]}) there, {data_path} "
                           f"(sha256 {digest[:12]}) here")
        if not differs:
            differs.append("the tokenized examples (another tokenizer?)")
        raise StoreMismatch(f"{manifest_path} was dumped from other data: {'; '.join(differs)}. Train on the data and "
                            "settings it was dumped with, or dump again into a new directory")

    def check_outputs(self, asked: OutputRequest) -> None:
        """StoreMismatch when the store cannot give what `asked` asks (a kind it lacks, another dtype)."""
        stored = set(self.request.kinds)
        missing = [kind for kind in asked if kind not in stored and not self._derivable(kind)]
        problems = []
        if missing:
            problems.append(f"this run asks for {', '.join(map(str, missing))}, which it does not hold")
        if asked.dtype != self.request.dtype:
            problems.append(f"this run asks for them in {wire.dtype_name(asked.dtype)}, it holds "
                            f"{wire.dtype_name(self.request.dtype)}")
        if problems:
            raise StoreMismatch(f"{self.directory / fmt.MANIFEST} holds {self.request}: {'; '.join(problems)}. Dump "
                                "what this run asks into a new directory, or train with the outputs it holds")

    def _derivable(self, kind: Output) -> bool:
        # An EAGLE-3 draft's subset logits come from the final hidden state and the head's rows.
        return isinstance(kind, SubsetLogits) and FinalHidden() in set(self.request.kinds) and self.head is not None

    def check_teacher(self, request: OutputRequest, model_name: str) -> None:
        """StoreMismatch when a live teacher (to write through) is not the one the store was made with."""
        theirs, ours = request.teacher, self.facts
        differs = [f"{name} {getattr(ours, name)} there, {getattr(theirs, name)} here"
                   for name in ("vocab_size", "hidden_size", "num_layers", "dtype", "tokenizer_fingerprint")
                   if getattr(theirs, name) != getattr(ours, name)]
        if request.kinds != self.request.kinds or request.dtype != self.request.dtype:
            differs.append(f"outputs {self.request} there, {request} here")
        if model_name != self.manifest["teacher"]["model"]:
            differs.append(f"model {self.manifest['teacher']['model']} there, {model_name} here")
        if differs:
            raise StoreMismatch(f"{self.directory / fmt.MANIFEST} was made with another teacher or outputs than the "
                                f"one given to fill it: {'; '.join(differs)}. Give the same teacher, or a new "
                                "directory")

    # ---- reading rows ----------------------------------------------------------------------

    def read(self, locations: list[tuple[int, int]], device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """The rows at `locations` as the layout's tensors of one batch, on `device` (ids unpacked
        there: on a GPU the unpacking costs the host nothing). Rows go from the file straight into
        one host buffer per tensor (pinned when `device` is a GPU, so the copy to it is asynchronous)."""
        device = torch.device(device)
        stored = self.read_stored(locations, pin=device.type == "cuda")
        with stage(self.times, "to the device + decode"):
            return [codec.decode(rows.to(device, non_blocking=True)) for codec, rows in zip(self.codecs, stored)]

    def read_stored(self, locations: list[tuple[int, int]], pin: bool = False) -> list[torch.Tensor]:
        """The rows at `locations` as stored (before unpacking), one tensor per codec, on the host."""
        return self.files.read_stored(locations, pin, self.times)

    # ---- writing rows ----------------------------------------------------------------------

    def shard_file(self, rows: int, frames: dict[str, int] | None = None) -> fmt.ShardFile:
        """A new shard file of `rows` rows, its rows to be put in as they come (`fmt.ShardFile`);
        `frames`: the bytes of each zstd codec's frames (known once they are compressed)."""
        specs = {fmt.ROW_KEY: (torch.uint8, (rows, 32)), fmt.ROW_SHA256: (torch.uint8, (rows, 32))}
        for codec in self.codecs:
            if codec.zstd_level:
                specs[codec.name] = (torch.uint8, (frames[codec.name],))
                specs[f"{codec.name}.offsets"] = (torch.int64, (rows + 1,))
            else:
                specs[codec.name] = stored_spec(codec, rows)
        return fmt.ShardFile(self.directory, specs, row_tensors=[codec.name for codec in self.codecs])

    def write_shard(self, keys: list[bytes], rows: dict[str, list[torch.Tensor]], tokens: int,
                    first_row: int | None = None) -> dict:
        """One shard of `rows` (each codec's encoded rows, on the host, in parts), written and then
        named in the manifest as the next shard (`first_row`: where a dump's rows start). Returns its
        manifest entry."""
        tensors: dict[str, list[torch.Tensor]] = {}
        frame_bytes: dict[str, list[int]] = {}  # each zstd codec's frames' sizes (its rows' bytes)
        for codec in self.codecs:
            if codec.zstd_level:
                with stage(self.times, "zstd"):
                    data, offsets = fmt.compress_rows(torch.cat(rows[codec.name]), codec.zstd_level)
                tensors[codec.name], tensors[f"{codec.name}.offsets"] = [data], [offsets]
                frame_bytes[codec.name] = offsets.diff().tolist()
            else:
                tensors[codec.name] = rows[codec.name]
        shard = self.shard_file(len(keys), {c.name: tensors[c.name][0].numel() for c in self.codecs if c.zstd_level})
        try:
            with stage(self.times, "write + sha256 (the file's, each row's)"):
                for name, parts in tensors.items():  # in the codecs' order, as a row's digest takes them
                    for part in parts:
                        shard.put(name, part, frame_bytes.get(name))
            return self.commit_shard(shard, keys, tokens, first_row)
        except BaseException:
            shard.abort()
            raise

    def commit_shard(self, shard: fmt.ShardFile, keys: list[bytes], tokens: int, first_row: int | None) -> dict:
        """Puts the row keys, syncs `shard`, renames it to the next shard's name and names it in the
        manifest (`first_row`: where a dump's rows start). Returns its manifest entry."""
        key_bytes = b"".join(keys)
        shard.put(fmt.ROW_KEY, torch.frombuffer(bytearray(key_bytes), dtype=torch.uint8))
        with stage(self.times, "row digests + fsync"):
            digests = shard.finish()
        entry = {"rows": len(keys), "tokens": int(tokens), **digests,
                 "row_keys_sha256": hashlib.sha256(key_bytes).hexdigest()}
        if first_row is not None:
            entry["first_row"] = first_row
        with fmt.locked(self.directory), stage(self.times, "rename + manifest"):
            manifest = fmt.read_manifest(self.directory)
            held = sum(shard_entry["rows"] for shard_entry in manifest["shards"])
            if first_row is not None and first_row != held:
                raise StoreError(f"{self.directory}: a dump's rows from {first_row} would follow the {held} rows its "
                                 "manifest holds (another process writing into the same directory?)")
            entry = {"file": f"shard-{len(manifest['shards']):06d}.safetensors", **entry}
            os.replace(shard.path, self.directory / entry["file"])  # complete before the manifest names it
            fmt.sync_directory(self.directory)
            manifest["shards"].append(entry)
            fmt.write_manifest(self.directory, manifest)
        with self.files.lock:
            self.manifest["shards"] = manifest["shards"]
            self.files.add(manifest["shards"])
        return entry

    @staticmethod
    def create(directory: str | Path, request: OutputRequest, *, teacher: dict, data: dict,
               pack_ids: bool = True, zstd_level: int = 0, head: JoinData | None = None,
               dump: dict | None = None, exist_ok: bool = False) -> None:
        """A new, empty store: its manifest (and the head, once). Refuses a directory that holds one,
        unless `exist_ok` (several ranks creating the same store: the first does, the others open
        it and check it against their run)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if zstd_level:
            fmt.zstd_module()  # refused now, not at the first shard
        per_batch = [kind for kind in request if isinstance(kind, Output) and kind.batch_field]
        if per_batch:
            raise StoreError(f"{request} reads data the student sends with each batch "
                             f"({', '.join(kind.batch_field for kind in per_batch)}): it cannot be stored; "
                             "ask the teacher for these outputs while training")
        codecs = fmt.codecs_for(request, data["seq_len"], pack=pack_ids, zstd_level=zstd_level)
        manifest = {"format": fmt.FORMAT, "teacher": teacher,
                    "outputs": {"spec": fmt.spec_to_json(output_spec(request.kinds, wire.dtype_name(request.dtype))),
                                "kinds": [str(kind) for kind in request], "dtype": wire.dtype_name(request.dtype),
                                "pack_ids": pack_ids, "zstd_level": zstd_level,
                                "tensors": [codec.to_json() for codec in codecs]},
                    "data": data, "dump": dump, "head": None, "shards": []}
        with fmt.locked(directory):
            if fmt.read_manifest(directory) is not None:
                if exist_ok:
                    return
                raise StoreError(f"{directory / fmt.MANIFEST} exists already")
            join_tensors = request.join_derive(head) if head is not None and request.join_layout() else []
            if join_tensors:
                data_bytes = fmt.serialize_shard({f"join.{i}": t.detach().cpu() for i, t in enumerate(join_tensors)})
                fmt.write_atomic(directory / fmt.HEAD_FILE, data_bytes)
                manifest["head"] = {"file": fmt.HEAD_FILE, "bytes": len(data_bytes),
                                    "sha256": hashlib.sha256(data_bytes).hexdigest()}
            fmt.write_manifest(directory, manifest)

