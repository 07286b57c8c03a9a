"""The shard files of one store directory, and its head: each file the manifest names opened
inside the directory and checked against the manifest before anything of it is used, the
index from a row's key to where it lies, and rows read from the shards (each row hashed and
checked against its digest as it is read).

What a manifest names is input from whoever wrote the directory: every file is opened by
`fmt.open_in_store` (inside the directory, a regular file), every entry's fields are checked for
their type before use, and every shape a shard or the head states is checked against the
manifest's codecs and the file's size before anything is allocated for it. The manifest itself
is student_trainer/store/directory.py's."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from distill_common import store as fmt
from distill_common.outputs import OutputHead, OutputRequest
from distill_common.store import StoreCorrupt
from student_trainer.store.timing import StageTimes, stage


@dataclass
class _Shard:
    path: Path
    relative: str  # its path from the resolved store directory (fmt.resolve_in_store), opened for each read
    entry: dict
    places: dict  # tensor name -> fmt.TensorPlace
    row_sha256: bytes  # its rows' digests, 32 bytes each (checked against the manifest)


class ShardFiles:
    """The shards a store's manifest names, opened and checked, their rows indexed by key and read."""

    def __init__(self, directory: Path, codecs: list[fmt.TensorCodec]):
        self.directory = directory
        self.manifest_path = directory / fmt.MANIFEST
        self.codecs = codecs
        self._root = os.path.realpath(directory)
        self.lock = threading.Lock()  # the index and the shards, read by some threads, added to by another
        self.shards: list[_Shard] = []
        self.index: dict[bytes, tuple[int, int]] = {}
        # Bytes of rows `read_stored` has read (the rows' tensors, zstd frames as stored; not the
        # frames' offsets, 8 bytes a row) and hashed to check them: each byte read is hashed once.
        self.row_bytes_read = 0
        self.row_bytes_hashed = 0

    def locate(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        with self.lock:
            return [self.index.get(key) for key in keys]

    def open(self, entry: dict, field: str, relative: str | None = None) -> tuple[int, Path]:
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

    def check_entry(self, entry: object, field: str, names: tuple[str, ...]) -> None:
        """StoreCorrupt naming the field unless `entry` (the manifest's `field`) holds `names`, each
        of its type: `file` a string (`_open` confines it), sizes whole numbers, digests sha256 hex."""
        if not isinstance(entry, dict):
            raise self.malformed(f"{field} is not a JSON object")
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
                raise self.malformed(f"{field}.{name} is {repr(value)[:80]}, not {kind}")

    def malformed(self, what: str) -> StoreCorrupt:
        return StoreCorrupt(f"{self.manifest_path}: malformed: {what}; not a manifest this project wrote (dump the "
                            "store again into a new directory)")

    def add(self, entries: list[dict]) -> None:
        """Opens the shards of `entries` this store has not opened: each one's size, header, row keys
        and row digests checked against the manifest (a few bytes a row; the rows themselves are
        checked as they are read)."""
        for number, entry in enumerate(entries[len(self.shards):], len(self.shards)):
            self.check_entry(entry, f"shards[{number}]", ("file", "rows", "bytes", "sha256", "header_sha256",
                                                           "row_keys_sha256", "row_sha256_sha256"))
            relative = fmt.resolve_in_store(self.directory, entry["file"],
                                            f"{self.manifest_path}'s shards[{number}].file")
            fd, path = self.open(entry, f"shards[{number}]", relative)
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
                expected[codec.name] = stored_spec(codec, rows)
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

    def check_whole(self, number: int) -> None:
        """StoreCorrupt unless shard `number`'s whole file has the sha256 the manifest records (what a
        resumed dump checks of the shards it continues after)."""
        shard = self.shards[number]
        fd, path = self.open(shard.entry, f"shards[{number}]", shard.relative)
        try:
            digest = fmt.sha256_of_fd(fd)
        finally:
            os.close(fd)
        if digest != shard.entry["sha256"]:
            raise StoreCorrupt(f"{path}: its sha256 differs from the one {self.manifest_path} records: the file "
                               "changed after it was written (a flipped byte, a copy gone wrong); nothing of it is "
                               "read (dump it again into a new directory)")

    def read_head(self, entry: object, request: OutputRequest) -> OutputHead | None:
        """The head the manifest names, read from its file: the file's header checked against the
        tensors the outputs' join layout holds (shapes from the teacher facts) and its size, each
        tensor read into its place and the whole file's sha256 checked before anything is used.
        Nothing of the file reaches a parser but this module's (`fmt.read_layout`)."""
        if not entry:
            return None
        self.check_entry(entry, "head", ("file", "bytes", "sha256"))
        expected = request.join_layout()
        if not expected:
            raise StoreCorrupt(f"{self.manifest_path}: it names a head, which its outputs ({request}) do not "
                               "use: not a manifest this project wrote (dump the store again into a new directory)")
        fd, path = self.open(entry, "head")
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
                pread_into(fd, view, offset, path)
                digest.update(view)
                tensors.append(tensor)
                offset += len(view)
        finally:
            os.close(fd)
        if digest.hexdigest() != entry["sha256"]:
            raise StoreCorrupt(f"{path}: its sha256 differs from the one {self.manifest_path} records: the file "
                               "changed after it was written (a flipped byte, a copy gone wrong); nothing of it is "
                               "read (dump it again into a new directory)")
        return request.join_assemble(tensors).head

    def read_stored(self, locations: list[tuple[int, int]], pin: bool = False,
                    times: StageTimes | None = None) -> list[torch.Tensor]:
        """The rows at `locations` as stored (before unpacking), one tensor per codec, on the host."""
        count = len(locations)
        columns = []
        for codec in self.codecs:
            dtype, shape = stored_spec(codec, count)
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
            with stage(times, "read rows (pread into the batch's buffers)"):
                fd, _ = self.open(shard.entry, f"shards[{number}]", shard.relative)
                try:
                    frames = {codec.name: self._read_frames(fd, shard, codec, row, rows)
                              for codec in self.codecs if codec.zstd_level}
                    for codec, column in zip(self.codecs, columns):
                        if not codec.zstd_level:
                            place = shard.places[codec.name]
                            row_bytes = (place.end - place.begin) // shard.entry["rows"]
                            pread_into(fd, fmt.tensor_bytes(column[position:position + rows]),
                                        place.begin + row * row_bytes, shard.path)
                finally:
                    os.close(fd)
            with stage(times, "sha256 of the rows read (each checked against its row_sha256)"):
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
                with stage(times, "zstd"):
                    for codec, column in zip(self.codecs, columns):
                        for index, frame in enumerate(frames.get(codec.name, ())):
                            column[position + index:position + index + 1] = fmt.decompress_row(frame, codec)
        with self.lock:
            self.row_bytes_read += read_bytes
            self.row_bytes_hashed += hashed_bytes
        return columns

    def _read_frames(self, fd: int, shard: _Shard, codec: fmt.TensorCodec, row: int, rows: int) -> list[bytes]:
        """The zstd frames of rows `row`.. of `codec`, as stored."""
        offsets_place, frames = shard.places[f"{codec.name}.offsets"], shard.places[codec.name]
        offsets = torch.empty(rows + 1, dtype=torch.int64)
        pread_into(fd, fmt.tensor_bytes(offsets), offsets_place.begin + row * 8, shard.path)
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


def stored_spec(codec: fmt.TensorCodec, rows: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of `rows` rows of a raw (not zstd) codec as a shard stores them."""
    if codec.bits:
        return torch.uint8, (rows, codec.row_bytes)
    return codec.dtype, (rows, *codec.row_shape)


def pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """`len(view)` bytes of the file from `offset` into `view` (os.preadv releases the GIL: the
    reads of several threads are in flight at once)."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise StoreCorrupt(f"{path} ended {len(view) - done} bytes early at byte {offset + done}: truncated "
                               "after it was opened")
        done += count
