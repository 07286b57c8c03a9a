"""One store directory: its manifest checked against a run, its index of rows, its shards read
(each row read checked against its digest) and written (atomically, then named in the
manifest).

A store is input from whoever wrote the directory: every file its manifest names is opened by
`fmt.open_in_store` (inside the directory, a regular file), every entry's fields are checked for
their type before use, and every shape a shard or the head states is checked against the
manifest's teacher facts (themselves bounded, `fmt.check_facts`) and the file's size before
anything is allocated for it."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common import wire
from distill_common.outputs import (FinalHidden, JoinData, Output, OutputHead, OutputRequest, SubsetLogits,
                                    TeacherFacts, output_spec)
from distill_common.store import StoreCorrupt, StoreError, StoreMismatch, StoreMissing
from student_trainer.client import TeacherInfo
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


@dataclass
class _Shard:
    path: Path
    relative: str  # its path from the resolved store directory (fmt.resolve_in_store), opened for each read
    entry: dict
    places: dict  # tensor name -> fmt.TensorPlace
    row_sha256: bytes  # its rows' digests, 32 bytes each (checked against the manifest)


class TeacherStore:
    """A store directory: its manifest, its index, its rows (see the module's docstring)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._root = os.path.realpath(self.directory)
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
        self._lock = threading.Lock()  # the index and the shards, read by some threads, added to by another
        self.shards: list[_Shard] = []
        self.index: dict[bytes, tuple[int, int]] = {}
        self.times: StageTimes | None = None  # where reads and writes spend their time, when asked (the bench)
        # Bytes of rows `read_stored` has read (the rows' tensors, zstd frames as stored; not the
        # frames' offsets, 8 bytes a row) and hashed to check them: each byte read is hashed once.
        self.row_bytes_read = 0
        self.row_bytes_hashed = 0
        self.head = self._read_head()
        self._manifest_mtime_ns = 0
        self._add_shards(manifest["shards"])

    # ---- what the store holds --------------------------------------------------------------

    @property
    def rows(self) -> int:
        return sum(shard.entry["rows"] for shard in self.shards)

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

    def _read_head(self) -> OutputHead | None:
        """The head the manifest names, read from its file: the file's header checked against the
        tensors the outputs' join layout holds (shapes from the teacher facts) and its size, each
        tensor read into its place and the whole file's sha256 checked before anything is used.
        Nothing of the file reaches a parser but this module's (`fmt.read_layout`)."""
        entry = self.manifest.get("head")
        if not entry:
            return None
        self._check_entry(entry, "head", ("file", "bytes", "sha256"))
        expected = self.request.join_layout()
        if not expected:
            raise StoreCorrupt(f"{self.manifest_path}: it names a head, which its outputs ({self.request}) do not "
                               "use: not a manifest this project wrote (dump the store again into a new directory)")
        fd, path = self._open(entry, "head")
        try:
            places, header = fmt.read_layout(fd, path, entry["bytes"])
            places = {name: (place.dtype, place.shape) for name, place in places.items()}
            wanted = {f"join.{index}": (spec.dtype, tuple(spec.shape)) for index, spec in enumerate(expected)}
            if places != wanted:
                raise StoreCorrupt(f"{path}: not a head this store wrote: it holds {places}, the manifest's outputs "
                                   f"hold {wanted}; nothing of it is read (dump the store again into a new directory)")
            digest, tensors, offset = hashlib.sha256(header), [], len(header)
            for dtype, shape in wanted.values():  # in file order: safetensors' order, as `read_layout` checked
                tensor = torch.empty(shape, dtype=dtype)
                view = fmt.tensor_bytes(tensor)
                _pread_into(fd, view, offset, path)
                digest.update(view)
                tensors.append(tensor)
                offset += len(view)
        finally:
            os.close(fd)
        if digest.hexdigest() != entry["sha256"]:
            raise StoreCorrupt(f"{path}: its sha256 differs from the one {self.manifest_path} records: the file "
                               "changed after it was written (a flipped byte, a copy gone wrong); nothing of it is "
                               "read (dump it again into a new directory)")
        return self.request.join_assemble(tensors).head

    def _check_entry(self, entry: object, field: str, names: tuple[str, ...]) -> None:
        """StoreCorrupt naming the field unless `entry` (the manifest's `field`) holds `names`, each
        of its type: `file` a string (`_open` confines it), sizes whole numbers, digests sha256 hex."""
        if not isinstance(entry, dict):
            raise self._malformed(f"{field} is not a JSON object")
        for name in names:
            value = entry.get(name)
            if name == "file":
                good = isinstance(value, str)
            elif name.endswith("sha256"):
                good = isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
            else:
                good = type(value) is int and value >= (1 if name == "rows" else 0)
            if not good:
                kind = ("a file name" if name == "file" else "a sha256 (64 hex digits)" if name.endswith("sha256")
                        else "a whole number above 0" if name == "rows" else "a whole number, 0 or more")
                raise self._malformed(f"{field}.{name} is {repr(value)[:80]}, not {kind}")

    def _malformed(self, what: str) -> StoreCorrupt:
        return StoreCorrupt(f"{self.manifest_path}: malformed: {what}; not a manifest this project wrote (dump the "
                            "store again into a new directory)")

    def _open(self, entry: dict, field: str, relative: str | None = None) -> tuple[int, Path]:
        """A descriptor of the file the manifest's `field` names (inside the store, a regular file:
        `fmt.open_in_store`; `relative`: where it was found to lie when the shard was opened) whose
        size is the one recorded, and its path for messages."""
        path, field = self.directory / entry["file"], f"{self.manifest_path}'s {field}.file"
        try:
            if relative is None:
                relative = fmt.resolve_in_store(self.directory, entry["file"], field)
            fd = fmt.open_resolved(self._root, relative, field, entry["file"])
        except FileNotFoundError:
            raise StoreCorrupt(f"{path} is missing: {self.manifest_path} names it ({entry['bytes']} bytes); the "
                               "store is incomplete (dump it again into a new directory)") from None
        size = os.fstat(fd).st_size
        if size != entry["bytes"]:
            os.close(fd)
            raise StoreCorrupt(f"{path} has {size} bytes, the manifest records {entry['bytes']}: the file is "
                               f"{'truncated' if size < entry['bytes'] else 'longer than written'}; nothing of it is "
                               "read (dump it again into a new directory)")
        return fd, path

    def check_whole(self, number: int) -> None:
        """StoreCorrupt unless shard `number`'s whole file has the sha256 the manifest records (what a
        resumed dump checks of the shards it continues after)."""
        shard = self.shards[number]
        fd, path = self._open(shard.entry, f"shards[{number}]", shard.relative)
        try:
            digest = fmt.sha256_of_fd(fd)
        finally:
            os.close(fd)
        if digest != shard.entry["sha256"]:
            raise StoreCorrupt(f"{path}: its sha256 differs from the one {self.manifest_path} records: the file "
                               "changed after it was written (a flipped byte, a copy gone wrong); nothing of it is "
                               "read (dump it again into a new directory)")

    def _add_shards(self, entries: list[dict]) -> None:
        """Opens the shards of `entries` this store has not opened: each one's size, header, row keys
        and row digests checked against the manifest (a few bytes a row; the rows themselves are
        checked as they are read)."""
        for number, entry in enumerate(entries[len(self.shards):], len(self.shards)):
            self._check_entry(entry, f"shards[{number}]", ("file", "rows", "bytes", "sha256", "header_sha256",
                                                           "row_keys_sha256", "row_sha256_sha256"))
            relative = fmt.resolve_in_store(self.directory, entry["file"],
                                            f"{self.manifest_path}'s shards[{number}].file")
            fd, path = self._open(entry, f"shards[{number}]", relative)
            try:
                places, header = fmt.read_layout(fd, path, entry["bytes"])
                self._check_digest(path, "header", header, entry["header_sha256"])
                self._check_places(path, places, entry["rows"])
                keys, row_sha256 = (os.pread(fd, places[name].end - places[name].begin, places[name].begin)
                                    for name in (fmt.ROW_KEY, fmt.ROW_SHA256))
            finally:
                os.close(fd)
            self._check_digest(path, "row keys (row_key)", keys, entry["row_keys_sha256"])
            self._check_digest(path, "row digests (row_sha256)", row_sha256, entry["row_sha256_sha256"])
            self.shards.append(_Shard(path, relative, entry, places, row_sha256))
            for row in range(entry["rows"]):
                self.index.setdefault(keys[row * 32:(row + 1) * 32], (number, row))

    def _check_digest(self, path: Path, what: str, data: bytes, recorded: str) -> None:
        if hashlib.sha256(data).hexdigest() != recorded:
            raise StoreCorrupt(f"{path}: the sha256 of its {what} is not the one {self.directory / fmt.MANIFEST} "
                               "records: the file changed after it was written (a flipped byte, a copy gone wrong); "
                               "nothing of it is read (dump it again into a new directory)")

    def _check_places(self, path: Path, places: dict, rows: int) -> None:
        """StoreCorrupt unless the shard holds each codec's tensor in the dtype and shape it stores."""
        expected = {fmt.ROW_KEY: (torch.uint8, (rows, 32)), fmt.ROW_SHA256: (torch.uint8, (rows, 32))}
        for codec in self.codecs:
            if codec.zstd_level:
                expected[f"{codec.name}.offsets"] = (torch.int64, (rows + 1,))
            else:
                expected[codec.name] = _stored_spec(codec, rows)
        found = {name: (place.dtype, place.shape) for name, place in places.items()}
        for name, (dtype, shape) in expected.items():
            if found.get(name) != (dtype, shape):
                raise StoreCorrupt(f"{path}: not a shard this store wrote: {name} is {found.get(name)}, its manifest "
                                   f"says {(dtype, shape)}; nothing of it is read (dump it again into a new directory)")
        for codec in self.codecs:
            if codec.zstd_level and (codec.name not in places or places[codec.name].dtype != torch.uint8
                                     or len(places[codec.name].shape) != 1):
                raise StoreCorrupt(f"{path}: not a shard this store wrote: {codec.name} is not one run of zstd "
                                   "frames; nothing of it is read (dump it again into a new directory)")

    def refresh(self) -> None:
        """Takes in the shards written since this store was opened (by another rank, say)."""
        changed = (self.directory / fmt.MANIFEST).stat().st_mtime_ns
        if changed == self._manifest_mtime_ns:
            return
        self._manifest_mtime_ns = changed
        manifest = fmt.read_manifest(self.directory)
        with self._lock:
            if manifest is not None and not isinstance(manifest.get("shards"), list):
                raise self._malformed("shards is not a list")
            if manifest is not None and len(manifest["shards"]) > len(self.shards):
                self.manifest["shards"] = manifest["shards"]
                self._add_shards(manifest["shards"])

    def locate(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        with self._lock:
            return [self.index.get(key) for key in keys]

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
        count = len(locations)
        columns = []
        for codec in self.codecs:
            dtype, shape = _stored_spec(codec, count)
            columns.append(torch.empty(shape, dtype=dtype, pin_memory=pin and torch.cuda.is_available()))
        # Runs of consecutive rows of one shard are read with one call each.
        runs: list[tuple[int, int, int, int]] = []  # (shard, first row, rows, first row of the batch)
        for position, (number, row) in enumerate(locations):
            if runs and runs[-1][0] == number and runs[-1][1] + runs[-1][2] == row:
                runs[-1] = (number, runs[-1][1], runs[-1][2] + 1, runs[-1][3])
            else:
                runs.append((number, row, 1, position))
        # Each run is read, then each of its rows hashed and checked against its digest; reads and
        # sha256 release the GIL, so the threads reading batches at once hash at once.
        read_bytes = hashed_bytes = 0
        for number, row, rows, position in runs:
            shard = self.shards[number]
            with stage(self.times, "read rows (pread into the batch's buffers)"):
                fd, _ = self._open(shard.entry, f"shards[{number}]", shard.relative)
                try:
                    frames = {codec.name: self._read_frames(fd, shard, codec, row, rows)
                              for codec in self.codecs if codec.zstd_level}
                    for codec, column in zip(self.codecs, columns):
                        if not codec.zstd_level:
                            place = shard.places[codec.name]
                            row_bytes = (place.end - place.begin) // shard.entry["rows"]
                            _pread_into(fd, fmt.tensor_bytes(column[position:position + rows]),
                                        place.begin + row * row_bytes, shard.path)
                finally:
                    os.close(fd)
            with stage(self.times, "sha256 of the rows read (each checked against its row_sha256)"):
                for index in range(rows):
                    digest = hashlib.sha256()
                    for codec, column in zip(self.codecs, columns):
                        data = frames[codec.name][index] if codec.zstd_level else fmt.tensor_bytes(
                            column[position + index:position + index + 1])
                        digest.update(data)
                        hashed_bytes += len(data)
                    stored = row + index
                    if digest.digest() != shard.row_sha256[32 * stored:32 * (stored + 1)]:
                        raise StoreCorrupt(
                            f"{shard.path}: row {stored} differs from its digest (row_sha256): the file changed "
                            "after it was written (a flipped byte, a copy gone wrong); the row is not read (dump "
                            "the store again into a new directory)")
            read_bytes += sum(len(frame) for codec_frames in frames.values() for frame in codec_frames) + sum(
                column[position:position + rows].nbytes for codec, column in zip(self.codecs, columns)
                if not codec.zstd_level)
            if frames:
                with stage(self.times, "zstd"):
                    for codec, column in zip(self.codecs, columns):
                        for index, frame in enumerate(frames.get(codec.name, ())):
                            column[position + index:position + index + 1] = fmt.decompress_row(frame, codec)
        with self._lock:
            self.row_bytes_read += read_bytes
            self.row_bytes_hashed += hashed_bytes
        return columns

    def _read_frames(self, fd: int, shard: _Shard, codec: fmt.TensorCodec, row: int, rows: int) -> list[bytes]:
        """The zstd frames of rows `row`.. of `codec`, as stored."""
        offsets_place, frames = shard.places[f"{codec.name}.offsets"], shard.places[codec.name]
        offsets = torch.empty(rows + 1, dtype=torch.int64)
        _pread_into(fd, fmt.tensor_bytes(offsets), offsets_place.begin + row * 8, shard.path)
        read = []
        for index in range(rows):
            begin, end = int(offsets[index]), int(offsets[index + 1])
            if not 0 <= begin <= end <= frames.end - frames.begin:
                raise StoreCorrupt(f"{shard.path}: {codec.name}'s row {row + index} lies outside its frames")
            frame = os.pread(fd, end - begin, frames.begin + begin)
            if len(frame) != end - begin:
                raise StoreCorrupt(f"{shard.path} ended early in {codec.name}'s row {row + index}: truncated after "
                                   "it was opened")
            read.append(frame)
        return read

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
                specs[codec.name] = _stored_spec(codec, rows)
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
        with self._lock:
            self.manifest["shards"] = manifest["shards"]
            self._add_shards(manifest["shards"])
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


def _stored_spec(codec: fmt.TensorCodec, rows: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of `rows` rows of a raw (not zstd) codec as a shard stores them."""
    if codec.bits:
        return torch.uint8, (rows, codec.row_bytes)
    return codec.dtype, (rows, *codec.row_shape)


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """`len(view)` bytes of the file from `offset` into `view` (os.preadv releases the GIL: the
    reads of several threads are in flight at once)."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise StoreCorrupt(f"{path} ended {len(view) - done} bytes early at byte {offset + done}: truncated "
                               "after it was opened")
        done += count
