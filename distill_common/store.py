"""The teacher-output store's format: safetensors shards and a JSON manifest.

A store is a directory:

    manifest.json                  what the store holds (below), written atomically
    head.safetensors               the teacher's output head, once (only for FinalHidden)
    shard-000000.safetensors ...   rows of outputs, each file complete or absent

A *row* is one example of the training data (`[seq_len]` token ids and mask) with its teacher
outputs. Every shard holds some rows; for each tensor a kind sends (`Output.layout`) it stores
`[rows, ...]`: the layout's shape with its batch axis moved first (HiddenStates' `[L, B, S, H]`
is stored `[rows, L, S, H]`), and `row_key` `[rows, 32]` uint8: `wire.batch_key` of the row's
ids and mask as int64 `[1, seq_len]`, so a row is found by what the trainer trains on and a
stored row can never be read for other tokens.

Encodings (each tensor's `encoding` in the manifest):

- `raw`: the tensor as the teacher produced it (float32, bfloat16, float16, int32).
- `bitsB`: int32 vocabulary ids (top-k ids, the argmax) packed to `B = ceil(log2(vocab))`
  bits each, row by row: uint8 `[rows, ceil(n * B / 8)]` where n is the row's id count.
  Id i of a row occupies bits `[i * B, (i + 1) * B)` of the row's bit stream, least
  significant bit first, and bit j of the stream is bit `j % 8` of byte `j // 8`
  (numpy's `bitorder="little"`).
- `zstd` on top of either (`"compression": "zstd"`): every row's bytes are one zstd frame;
  the tensor is uint8 `[total]` (the frames end to end) and `NAME.offsets` int64 `[rows + 1]`
  says where row r's frame lies: `[offsets[r], offsets[r + 1])`.

Reading top-k ids without this project (docs/training.md#the-stores-format has the whole
example; `seq`, `k` and `B` from the manifest's `outputs.tensors`):

    from safetensors import safe_open   # memory-mapped
    import numpy as np
    with safe_open("shard-000000.safetensors", "pt") as f:
        values = f.get_tensor("TopK.0")          # [rows, seq, k] in the manifest's dtype
        packed = f.get_tensor("TopK.1").numpy()   # [rows, ceil(seq * k * B / 8)] uint8
    rows = packed.shape[0]
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :seq * k * B].reshape(rows, seq * k, B)
    ids = (bits.astype(np.int64) << np.arange(B)).sum(-1).reshape(rows, seq, k)

A shard is a safetensors file as `safetensors.torch.save` lays it out (metadata
`{"format": FORMAT}`; tensors ordered by dtype, then name; the header padded with spaces to 8
bytes): `ShardFile` writes those bytes itself, rows at their place as they come, so that a
dump writes a batch once it is on the host and never copies a shard whole.

Safety. A shard is written under a temporary name, synced and renamed before the manifest
names it; the manifest is replaced atomically the same way. A file the manifest does not name
(a shard written when the process died before the manifest named it, a temporary file) is not
part of the store. Every byte a reader reads is checked against a digest, and nothing else is
read: a shard holds `row_sha256` `[rows, 32]` uint8, row r's the sha256 of that row's stored
bytes: each tensor of `outputs.tensors`, in that order, its bytes of row r as they lie in the
file (`[rows, ...]` tensors: their row r; zstd: row r's frame as stored, the bytes
`[offsets[r], offsets[r + 1])` of NAME). The manifest's entry of a shard records its `bytes`
and `sha256` (the whole file: what a resumed dump and tools that copy a store check), and
`header_sha256` (the 8-byte length and the JSON header), `row_keys_sha256` and
`row_sha256_sha256` (the bytes of those two tensors), which a reader checks when it opens the
store. A reader then checks each row it reads against its `row_sha256`; a shard whose size
differs, or whose header, keys, digests or a row read differ from what is recorded is refused
(`StoreCorrupt`) naming the file (and the row), never read around or recomputed.

A store is input from whoever wrote the directory. A reader opens only regular files inside it
(`open_in_store`: a name with `..` or absolute, or a link leading out, is refused with the same
message whether the file outside exists or not; a FIFO or device is refused without blocking);
reads a manifest of at most MAX_MANIFEST_BYTES, nested at most MAX_MANIFEST_DEPTH deep, both
checked before it is parsed; checks each entry's fields for their type, the teacher facts against
FACT_LIMITS and MAX_SEQ_LEN, and every shape a shard's or the head's header states against the
facts and the file's size, before anything is allocated for it. A dump started again removes the
temporary files (`.shard-PID-HEX.tmp`, `.manifest.json.tmp-PID`) of writers no longer running.

Checking a shard without this project (`tensors`: the manifest's `outputs.tensors`; `entry`:
the shard's entry in `shards`):

    import hashlib, json, struct
    data = open(entry["file"], "rb").read()
    assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
    length = struct.unpack("<Q", data[:8])[0]
    assert hashlib.sha256(data[:8 + length]).hexdigest() == entry["header_sha256"]
    header, start = json.loads(data[8:8 + length]), 8 + length
    def span(name):                                   # a tensor's bytes
        begin, end = header[name]["data_offsets"]
        return data[start + begin:start + end]
    def row(name, r, rows):                           # row r of a [rows, ...] tensor
        whole = span(name)
        return whole[r * len(whole) // rows:(r + 1) * len(whole) // rows]
    digests = span("row_sha256")
    assert hashlib.sha256(digests).hexdigest() == entry["row_sha256_sha256"]
    for r in range(entry["rows"]):
        h = hashlib.sha256()
        for tensor in tensors:
            if tensor["compression"] == "zstd":
                offsets = struct.unpack(f"<{entry['rows'] + 1}q", span(tensor["name"] + ".offsets"))
                h.update(span(tensor["name"])[offsets[r]:offsets[r + 1]])
            else:
                h.update(row(tensor["name"], r, entry["rows"]))
        assert h.digest() == digests[32 * r:32 * (r + 1)]
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from distill_common import wire
from distill_common.outputs import OutputRequest, TeacherFacts
from distill_common.proto.teacher.v1 import teacher_pb2 as pb

# The format's version; a store of another one is refused (dump it again). 2: per-row digests.
FORMAT = "teacher-outputs/2"
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
ROW_KEY = "row_key"
ROW_SHA256 = "row_sha256"
LOCK_FILE = ".lock"
# A manifest longer than this is refused before it is read (one of this project's holds some 400
# bytes a shard: this is some 40,000 shards; a dump with more takes a larger --rows-per-shard).
MAX_MANIFEST_BYTES = 16 << 20
# JSON nested deeper than this is refused before it is parsed (a manifest this project writes nests
# 5 deep, every output kind asked; a shard's header 3).
MAX_MANIFEST_DEPTH = 32
MAX_HEADER_DEPTH = 4
# The largest teacher a store describes (a manifest's `teacher.facts`; `data.seq_len`): every shape
# a store holds is derived from these, and a manifest stating more is refused before any of them is
# allocated. Released models stay far below (vocabularies up to 262,144, hidden sizes up to 25,600).
FACT_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_layers": 1 << 10,
               "attention.query_width": 1 << 18, "attention.key_width": 1 << 18,
               "attention.value_width": 1 << 18}
MAX_SEQ_LEN = 1 << 20
# The temporary files a store's writers create: a shard's (`ShardFile`) and a file written
# atomically (`write_atomic`); a dump removes those a killed writer left (`remove_stale_temporaries`).
_TEMPORARY = re.compile(r"\.shard-(?P<shard_pid>\d+)-[0-9a-f]+\.tmp"
                        r"|\.(?:manifest\.json|head\.safetensors)\.tmp-(?P<file_pid>\d+)")


class StoreError(ValueError):
    """The store cannot be used as asked; the message names the file and what to change."""


class StoreCorrupt(StoreError):
    """A file of the store differs from what its manifest records (size, digest)."""


class StoreMismatch(StoreError):
    """The store was made for other data, packing, outputs or another teacher than this run's."""


class StoreMissing(StoreError):
    """A batch's rows are not in the store and no teacher was given to compute them."""


def id_bits(vocab_size: int) -> int:
    """Bits per vocabulary id: ceil(log2(vocab_size)) (17 for 128k)."""
    return max(1, (int(vocab_size) - 1).bit_length())


def row_key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bytes:
    """The key of one row ([seq] ids and mask): the digest the teacher's batch header uses."""
    return wire.batch_key(input_ids.reshape(1, -1).to(torch.int64), attention_mask.reshape(1, -1).to(torch.int64))


# ---- ids packed to the vocabulary's bits (on the device that holds them) ------------------------


def pack_ids(ids: torch.Tensor, bits: int, check: bool = True) -> torch.Tensor:
    """int ids [rows, n] (each in [0, 2**bits)) -> uint8 [rows, ceil(n * bits / 8)], as the module says.

    `check=False` leaves the range check to the caller (`ids_out_of_range`), so that packing on a GPU
    does not wait for the device."""
    rows, n = ids.shape
    if check and n and bool(ids_out_of_range(ids, bits)):
        raise StoreError(ids_error(bits))
    shifts = torch.arange(bits, device=ids.device, dtype=torch.int32)
    stream = ((ids.to(torch.int32)[..., None] >> shifts) & 1).to(torch.uint8).reshape(rows, n * bits)
    pad = (-n * bits) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = (1 << torch.arange(8, device=ids.device, dtype=torch.int32))
    return (stream.reshape(rows, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def ids_out_of_range(ids: torch.Tensor, bits: int) -> torch.Tensor:
    """A 0-d bool tensor on the ids' device: whether any lies outside [0, 2**bits)."""
    return ((ids < 0) | (ids >= 1 << bits)).any()


def ids_error(bits: int) -> str:
    return (f"ids outside [0, 2**{bits}) cannot be packed to {bits} bits: the outputs do not match the vocabulary the "
            "store was made for")


def unpack_ids(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """uint8 [rows, nbytes] -> int32 ids [rows, n]: the inverse of `pack_ids`."""
    rows = packed.shape[0]
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[..., None] >> shifts8) & 1).reshape(rows, -1)[:, :n * bits]
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream.reshape(rows, n, bits) << shifts).sum(-1, dtype=torch.int32)


# ---- one stored tensor ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorCodec:
    """How one tensor of the layout is stored (see the module's docstring)."""

    name: str  # "<Kind>.<index in the kind's layout>", e.g. "TopK.1"
    row_shape: tuple[int, ...]  # the layout's shape without its batch axis
    dtype: torch.dtype
    batch_axis: int
    bits: int = 0  # > 0: int32 ids packed to this many bits
    zstd_level: int = 0  # > 0: each row a zstd frame

    @property
    def row_elements(self) -> int:
        count = 1
        for size in self.row_shape:
            count *= size
        return count

    @property
    def row_bytes(self) -> int:
        """Bytes of one row before zstd."""
        if self.bits:
            return -(-self.row_elements * self.bits // 8)
        return self.row_elements * torch.empty((), dtype=self.dtype).element_size()

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """A batch's tensor as the layout gives it -> its rows as stored before zstd (on its device)."""
        rows = tensor.movedim(self.batch_axis, 0)
        if self.bits:  # the range is checked by the writer, once the device is done (ids_out_of_range)
            return pack_ids(rows.reshape(rows.shape[0], -1), self.bits, check=False)
        return rows.contiguous()

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Rows as stored (after zstd) -> the batch's tensor in the layout's shape."""
        rows = stored.shape[0]
        if self.bits:
            stored = unpack_ids(stored, self.row_elements, self.bits).reshape(rows, *self.row_shape)
        return stored.movedim(0, self.batch_axis)

    def to_json(self) -> dict:
        return {"name": self.name, "row_shape": list(self.row_shape), "dtype": wire.dtype_name(self.dtype)
                if self.dtype.is_floating_point else str(self.dtype).removeprefix("torch."),
                "batch_axis": self.batch_axis, "encoding": f"bits{self.bits}" if self.bits else "raw",
                "compression": "zstd" if self.zstd_level else "none"}


def codecs_for(request: OutputRequest, seq_len: int, *, pack: bool = True, zstd_level: int = 0) -> list[TensorCodec]:
    """The stored tensors of `request` for rows of `seq_len`, in send order: int32 tensors (ids)
    packed to the vocabulary's bits when `pack`."""
    bits = id_bits(request.teacher.vocab_size)
    codecs = []
    for kind in request:
        one = kind.layout(1, seq_len, request.teacher, request.dtype)
        two = kind.layout(2, seq_len, request.teacher, request.dtype)
        for index, (a, b) in enumerate(zip(one, two)):
            axis = next(i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y)
            row_shape = a.shape[:axis] + a.shape[axis + 1:]
            codecs.append(TensorCodec(f"{type(kind).__name__}.{index}", tuple(row_shape), a.dtype, axis,
                                      bits if pack and a.dtype == torch.int32 else 0, zstd_level))
    return codecs


def kind_names(request: OutputRequest) -> list[str]:
    return [type(kind).__name__ for kind in request]


# ---- zstd (the `zstandard` package, an optional extra) -------------------------------------------


def zstd_module():
    try:
        import zstandard
    except ImportError as e:
        raise StoreError("zstd compression needs the zstandard package: pip install 'teacher-service[store-zstd]' "
                         "(or dump without --zstd-level)") from e
    return zstandard


def compress_rows(rows: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host rows [rows, ...] -> (uint8 frames end to end, int64 offsets [rows + 1])."""
    compressor = zstd_module().ZstdCompressor(level=level)
    flat = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    frames = [compressor.compress(row.tobytes()) for row in flat]
    offsets = [0]
    for frame in frames:
        offsets.append(offsets[-1] + len(frame))
    data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8) if offsets[-1] else torch.empty(
        0, dtype=torch.uint8)
    return data, torch.tensor(offsets, dtype=torch.int64)


def decompress_row(frame: bytes, codec: TensorCodec) -> torch.Tensor:
    raw = zstd_module().ZstdDecompressor().decompress(frame, max_output_size=codec.row_bytes)
    if len(raw) != codec.row_bytes:
        raise StoreCorrupt(f"a zstd frame of {codec.name} holds {len(raw)} bytes, a row has {codec.row_bytes}")
    stored_dtype = torch.uint8 if codec.bits else codec.dtype
    shape = (-1,) if codec.bits else codec.row_shape
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(stored_dtype).reshape(1, *shape)


# ---- the files of a store: opened inside its directory only, written atomically -----------------


def open_in_store(directory: Path, name: object, field: str) -> int:
    """A read-only descriptor of the regular file `name` (what a manifest names, `field` saying
    where: "DIR/manifest.json's shards[2].file") inside the store `directory`: `resolve_in_store`,
    then `open_resolved`."""
    return open_resolved(os.path.realpath(directory), resolve_in_store(directory, name, field), field, name)


def resolve_in_store(directory: Path, name: object, field: str) -> str:
    """Where `name` (what a manifest's `field` names) lies in the store `directory`: its path from
    the resolved directory, links followed. A store is input from whoever wrote the directory, so
    the name is confined before anything is opened: a relative path without `..` that, resolved,
    stays inside the resolved directory. StoreCorrupt otherwise, the same for any path outside
    whether it exists or not: the message tells nothing of files outside the store."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise _refused(field, name, "not a file name")
    if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
        raise _refused(field, name, _outside(directory))
    root = os.path.realpath(directory)
    relative = os.path.relpath(os.path.realpath(os.path.join(root, name)), root)
    if relative == os.curdir:
        raise _refused(field, name, "not a regular file (a directory)")
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        raise _refused(field, name, _outside(directory))
    return relative


def open_resolved(root: str, relative: str, field: str, name: object) -> int:
    """A read-only descriptor of the regular file at `relative` (`resolve_in_store`'s) in the
    resolved store directory `root`: each component opened from the directory with O_NOFOLLOW (a
    link swapped in since it was resolved is refused, not followed), the file with O_NONBLOCK (a
    FIFO does not block the open, the flag cleared once fstat says a regular file). StoreCorrupt
    otherwise; FileNotFoundError when the file does not exist."""
    *folders, file_name = relative.split(os.sep)
    directory_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory_fd)
            os.close(directory_fd)
            directory_fd = inner
        fd = os.open(file_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=directory_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link where the name resolved to none
            raise _refused(field, name, _outside(root)) from None
        raise
    finally:
        os.close(directory_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refused(field, name, "not a regular file (a FIFO, a device, a directory)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _outside(directory) -> str:
    return (f"a path outside {directory} (absolute, through '..', or a link leading out of it): a store reads only "
            "files inside its directory")


def _refused(field: str, name: object, why: str) -> StoreCorrupt:
    return StoreCorrupt(f"{field} is {repr(name)[:200]}: {why}; nothing of it is read (dump the store again into a "
                        "new directory)")


def read_at_most(fd: int, limit_bytes: int) -> bytes | None:
    """The file at `fd` from its start, if it holds at most `limit_bytes` (None otherwise): its size
    checked with fstat before anything is read, and reading stops past the limit if it grows."""
    if os.fstat(fd).st_size > limit_bytes:
        return None
    parts, total = [], 0
    while total <= limit_bytes:
        part = os.pread(fd, limit_bytes + 1 - total, total)
        if not part:
            break
        parts.append(part)
        total += len(part)
    return b"".join(parts) if total <= limit_bytes else None


def json_depth(data: bytes) -> int:
    """How deep the JSON text `data` nests its arrays and objects, counted without parsing it (its
    strings taken out first), so that a deeply nested text is refused before the parser recurses."""
    import numpy as np

    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_A_BRACKET), dtype=np.uint8)
    if not len(brackets):
        return 0
    return int(np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)).max())


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = bytes(byte for byte in range(256) if byte not in b"[]{}")


def loads_bounded(data: bytes, max_depth: int, what: str) -> object:
    """`data` parsed as JSON nested at most `max_depth` deep; ValueError saying `what` otherwise."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"{what} nests {depth} deep, more than the {max_depth} it may")
    try:
        return json.loads(data)
    except RecursionError as e:
        raise ValueError(f"{what} nests too deep to parse") from e


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, or `path` unchanged: a temporary file, synced, renamed, the directory synced.
    The temporary file is created anew (O_EXCL, O_NOFOLLOW): a file or link of its name that another
    process left is removed first, never written through."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextlib.contextmanager
def locked(directory: Path):
    """The store's lock, held while its manifest is read, changed and written (dump, write-through
    from several ranks). The lock file is never a link followed out of the store."""
    try:  # O_NONBLOCK: a FIFO of its name does not block the open (flock waits all the same)
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StoreError(f"{Path(directory) / LOCK_FILE}: cannot open the store's lock ({e}): remove it if it is "
                         "not a regular file") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{Path(directory) / LOCK_FILE} is not a regular file: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Removes the temporary files a writer of this store left when it was killed: regular files
    directly inside `directory` whose names are those writers create, of a process that is not
    running on this host (another dump's files in progress are left alone). Returns their names."""
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            found = _TEMPORARY.fullmatch(entry.name)
            if found is None or not entry.is_file(follow_symlinks=False):
                continue
            pid = int(found["shard_pid"] or found["file_pid"])
            if pid != os.getpid() and _running(pid):
                continue
            os.unlink(os.path.join(directory, entry.name))
            removed.append(entry.name)
    return sorted(removed)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False
    return True


def sha256_of_fd(fd: int, chunk_bytes: int = 16 << 20) -> str:
    """The sha256 of the file open at `fd`, from its start (as `sha256_of`)."""
    digest, buffer = hashlib.sha256(), bytearray(chunk_bytes)
    view, offset = memoryview(buffer), 0
    while count := os.preadv(fd, [buffer], offset):
        digest.update(view[:count])
        offset += count
    return digest.hexdigest()


def sha256_of(path: Path, chunk_bytes: int = 16 << 20) -> str:
    """The file's sha256, read in large chunks into one buffer (reads and hashing release the GIL,
    so several files are hashed at once by several threads)."""
    digest, buffer = hashlib.sha256(), bytearray(chunk_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def serialize_shard(tensors: dict[str, torch.Tensor]) -> bytes:
    """A small file's bytes (the head) by safetensors itself; shards are written by `ShardFile`,
    which lays them out byte for byte as this does."""
    from safetensors.torch import save

    return save({name: tensor.contiguous() for name, tensor in sorted(tensors.items())}, metadata={"format": FORMAT})


# ---- the safetensors layout, written and read without a copy ---------------------------------------

# safetensors' dtype names, in the order its writer lays tensors out (this order, then by name).
_SAFETENSORS_DTYPES = [(torch.uint64, "U64"), (torch.int64, "I64"), (torch.float64, "F64"), (torch.float32, "F32"),
                       (torch.uint32, "U32"), (torch.int32, "I32"), (torch.bfloat16, "BF16"), (torch.float16, "F16"),
                       (torch.uint16, "U16"), (torch.int16, "I16"), (torch.int8, "I8"), (torch.uint8, "U8"),
                       (torch.bool, "BOOL")]
_DTYPE_NAME = {dtype: name for dtype, name in _SAFETENSORS_DTYPES}
_DTYPE_OF = {name: dtype for dtype, name in _SAFETENSORS_DTYPES}
_DTYPE_RANK = {dtype: rank for rank, (dtype, _) in enumerate(_SAFETENSORS_DTYPES)}
# A header longer than this is not one this store wrote (a shard's names a handful of tensors).
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorPlace:
    """Where one tensor lies in a shard file: bytes [begin, end) of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def shard_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, TensorPlace]]:
    """The 8-byte length and JSON header of a shard holding tensors of these (dtype, shape), and
    where each tensor's bytes go: safetensors' own layout (tensors by dtype, then name; the header
    padded with spaces to 8 bytes), so a file written this way equals `safetensors.torch.save`'s."""
    order = sorted(specs, key=lambda name: (_DTYPE_RANK[specs[name][0]], name))
    header: dict = {"__metadata__": {"format": FORMAT}}
    offset, spans = 0, {}
    for name in order:
        dtype, shape = specs[name]
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPE_NAME[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans[name] = (dtype, tuple(shape), offset, offset + nbytes)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = len(text).to_bytes(8, "little") + text
    return prefix, {name: TensorPlace(dtype, shape, len(prefix) + begin, len(prefix) + end)
                    for name, (dtype, shape, begin, end) in spans.items()}


def read_layout(fd: int, path: Path, size: int) -> tuple[dict[str, TensorPlace], bytes]:
    """Where each tensor of the shard open at `fd` (`size` bytes) lies, from its header, and the
    header's bytes (its 8-byte length and JSON, for their digest); StoreCorrupt naming `path` when
    the header is not a safetensors header that fits the file."""
    def corrupt(what: str) -> StoreCorrupt:
        return StoreCorrupt(f"{path}: not a shard this store wrote ({what}); nothing of it is read (dump it again "
                            "into a new directory)")

    prefix = os.pread(fd, 8, 0)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise corrupt(f"a header of {length} bytes in a file of {size}")
    text = os.pread(fd, length, 8)
    try:
        header = loads_bounded(text, MAX_HEADER_DEPTH, "its header")
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise corrupt(f"its header is not a safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    header.pop("__metadata__", None)
    places, data_start, end = {}, 8 + length, 8 + length
    try:
        for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
            dtype, shape = _DTYPE_OF[entry["dtype"]], tuple(_whole(size) for size in entry["shape"])
            begin, stop = (_whole(offset) for offset in entry["data_offsets"])
            count = 1
            for dim in shape:
                count *= dim
            if begin + data_start != end or stop - begin != count * torch.empty((), dtype=dtype).element_size():
                raise corrupt(f"{name}'s bytes [{begin}, {stop}) do not follow the tensor before it or its shape")
            places[name] = TensorPlace(dtype, shape, data_start + begin, data_start + stop)
            end = data_start + stop
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise corrupt(f"a malformed header entry: {type(e).__name__}: {e}") from e
    if end != size:
        raise corrupt(f"its tensors end at byte {end}, the file has {size}")
    return places, prefix + text


def _whole(value: object) -> int:
    """A size or offset of a header: a whole number, not negative (ValueError otherwise)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a size (a whole number, 0 or more)")
    return value


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


class ShardFile:
    """One shard, written under a temporary name in `directory` while its rows come in: the header
    first, then each tensor's rows at their place (so a dump writes a batch as soon as it is on
    the host, not when the shard is full), the sha256 computed in file order as the bytes become
    contiguous. With `row_tensors` (the tensors a row's digest covers, in their order; `specs`
    then holds ROW_SHA256 `[rows, 32]` uint8) each row's sha256 is computed as its bytes are put
    and `finish` writes them. `finish` checks that every byte was written and syncs the file; the
    store then renames it to its shard's name. The bytes equal `safetensors.torch.save`'s of the
    whole tensors."""

    def __init__(self, directory: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 row_tensors: list[str] | tuple[str, ...] = ()):
        header, self.places = shard_layout(specs)
        self.header_sha256 = hashlib.sha256(header).hexdigest()
        self.size = max([len(header)] + [place.end for place in self.places.values()])
        self._filled = {name: place.begin for name, place in self.places.items()}  # next byte to write
        self._digest = hashlib.sha256()
        self._hashed = 0
        self._held: dict[int, memoryview] = {}  # written, not yet hashed (a byte before them is not in yet)
        self._row_order = {name: index for index, name in enumerate(row_tensors)}
        rows = specs[ROW_SHA256][1][0] if row_tensors else 0
        self._row_digests = [hashlib.sha256() for _ in range(rows)]
        self._row_parts = [0] * rows  # of each row: how many of `row_tensors` its digest has taken
        self._rows_put = dict.fromkeys(row_tensors, 0)
        # A new file of a name no other writer picks (_TEMPORARY): never one another process left, or
        # a link it planted.
        self.path = Path(directory) / f".shard-{os.getpid()}-{secrets.token_hex(8)}.tmp"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        self._write(0, memoryview(header))

    def put(self, name: str, rows: torch.Tensor, row_bytes: list[int] | None = None) -> None:
        """The next rows of tensor `name` (on the host, contiguous). `row_bytes`: the bytes of each
        row, for a tensor whose rows differ in size (zstd frames end to end); by default the rows
        are `rows`' first axis."""
        view = tensor_bytes(rows.contiguous())
        offset = self._filled[name]
        if offset + len(view) > self.places[name].end:
            raise StoreError(f"{name}: {len(view)} more bytes than the shard's header has room for")
        self._filled[name] = offset + len(view)
        self._write(offset, view)
        if name in self._row_order:
            if row_bytes is None:
                row_bytes = [len(view) // len(rows)] * len(rows) if len(rows) else []
            self._hash_rows(name, view, row_bytes)

    def _hash_rows(self, name: str, view: memoryview, sizes: list[int]) -> None:
        """Each row's bytes into its digest, which takes `row_tensors` in their order."""
        first, order = self._rows_put[name], self._row_order[name]
        if sum(sizes) != len(view) or first + len(sizes) > len(self._row_digests):
            raise StoreError(f"{name}: {len(sizes)} rows of {len(view)} bytes do not fit its rows "
                             f"{first}.. of {len(self._row_digests)} ({sizes})")
        begin = 0
        for row, size in enumerate(sizes, first):
            if self._row_parts[row] != order:
                raise StoreError(f"{name}: row {row} put before the tensors that come before it in its digest")
            self._row_digests[row].update(view[begin:begin + size])  # releases the GIL for a large row
            self._row_parts[row] += 1
            begin += size
        self._rows_put[name] = first + len(sizes)

    def _write(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):  # os.pwrite releases the GIL, as hashlib does for large buffers
            done += os.pwrite(self._fd, view[done:], offset + done)
        if len(view):
            self._held[offset] = view
        while self._hashed in self._held:
            part = self._held.pop(self._hashed)
            self._digest.update(part)
            self._hashed += len(part)

    def sync(self) -> None:
        """The bytes written so far, to the disk (so that `finish` waits for the last rows only)."""
        os.fdatasync(self._fd)

    def finish(self) -> dict:
        """Writes the rows' digests, syncs and closes the complete file; returns what the manifest
        records of it: `bytes`, `sha256`, `header_sha256` and, with row digests, `row_sha256_sha256`."""
        digests = {}
        if self._row_digests:
            unfinished = [row for row, parts in enumerate(self._row_parts) if parts != len(self._row_order)]
            if unfinished:
                raise StoreError(f"{self.path}: rows {unfinished[:8]} lack some of their tensors")
            row_sha256 = b"".join(digest.digest() for digest in self._row_digests)
            self.put(ROW_SHA256, torch.frombuffer(bytearray(row_sha256), dtype=torch.uint8))
            digests["row_sha256_sha256"] = hashlib.sha256(row_sha256).hexdigest()
        short = [name for name, place in self.places.items() if self._filled[name] != place.end]
        if short or self._hashed != self.size:
            raise StoreError(f"{self.path}: {', '.join(short) or 'the header'} not written whole")
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return {"bytes": self.size, "sha256": self._digest.hexdigest(), "header_sha256": self.header_sha256, **digests}

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.path.unlink(missing_ok=True)


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the manifest --------------------------------------------------------------------------------


def facts_to_json(facts: TeacherFacts) -> dict:
    info = pb.TeacherInfo(vocab_size=facts.vocab_size, hidden_size=facts.hidden_size, num_layers=facts.num_layers,
                          dtype=wire.dtype_name(facts.dtype), tokenizer_fingerprint=facts.tokenizer_fingerprint,
                          max_score_ids=facts.max_score_ids, topk_form=facts.topk_form)
    info.head.CopyFrom(facts.head.to_info())
    info.quantization.CopyFrom(facts.quantization.to_info())
    info.attention.CopyFrom(facts.attention.to_info())
    return _message_to_json(info)


def facts_from_json(value: dict) -> TeacherFacts:
    return TeacherFacts.from_info(_message_from_json(value, pb.TeacherInfo()))


def spec_to_json(spec: pb.OutputSpec) -> dict:
    return _message_to_json(spec)


def spec_from_json(value: dict) -> pb.OutputSpec:
    return _message_from_json(value, pb.OutputSpec())


def _message_from_json(value: dict, message):
    """`message` filled from `value`; ValueError when `value` is not one (a manifest is input)."""
    from google.protobuf import json_format

    try:
        return json_format.ParseDict(value, message)
    except json_format.ParseError as e:
        raise ValueError(f"not a {type(message).__name__}: {e}") from e


def _message_to_json(message) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def read_manifest(directory: Path) -> dict | None:
    """The manifest of the store at `directory` (None when it has none), checked to be a JSON object
    of this format: read from a regular file of at most MAX_MANIFEST_BYTES (its size checked before
    it is read), nested at most MAX_MANIFEST_DEPTH deep (checked before it is parsed)."""
    path = Path(directory) / MANIFEST
    try:
        fd = open_in_store(Path(directory), MANIFEST, str(path))
    except FileNotFoundError:
        return None
    try:
        data = read_at_most(fd, MAX_MANIFEST_BYTES)
    finally:
        os.close(fd)
    if data is None:
        raise StoreCorrupt(f"{path} is longer than {MAX_MANIFEST_BYTES >> 20} MiB (MAX_MANIFEST_BYTES), more than a "
                           "manifest this project writes: not read (dump the store again into a new directory)")
    try:
        manifest = loads_bounded(data, MAX_MANIFEST_DEPTH, "it")
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise StoreCorrupt(f"{path}: not a readable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreCorrupt(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                           f"this version reads {FORMAT!r} (whose shards hold a digest of each row): dump the "
                           "store again into a new directory")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> None:
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    if len(data) > MAX_MANIFEST_BYTES:
        raise StoreError(f"{Path(directory) / MANIFEST} would hold {len(data)} bytes, more than the "
                         f"{MAX_MANIFEST_BYTES >> 20} MiB a reader reads (MAX_MANIFEST_BYTES): dump into a new "
                         "directory with a larger --rows-per-shard (fewer shards)")
    write_atomic(Path(directory) / MANIFEST, data)


def check_facts(facts: TeacherFacts, seq_len: int, manifest_path: Path) -> None:
    """StoreCorrupt naming the field when a manifest's teacher facts or row length exceed what a
    store describes (FACT_LIMITS, MAX_SEQ_LEN): every shape of its shards is derived from them."""
    import operator

    stated = [(f"teacher.facts.{name}", operator.attrgetter(name)(facts), limit) for name, limit in FACT_LIMITS.items()]
    for field, value, limit in [*stated, ("data.seq_len", seq_len, MAX_SEQ_LEN)]:
        if not 0 <= value <= limit:
            raise StoreCorrupt(f"{manifest_path}: {field} is {value}, outside [0, {limit}], the largest a store "
                               "describes: not a manifest this project wrote; nothing of the store is read (dump it "
                               "again into a new directory)")
