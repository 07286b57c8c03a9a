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

Safety. A shard is written under a temporary name, synced and renamed before the manifest
names it; the manifest is replaced atomically the same way. The manifest records each
shard's size and sha256 (and the sha256 of its row keys, checked when a store is opened);
a shard whose size or digest differs is refused (`StoreCorrupt`) naming the file, never
read around or recomputed. A file the manifest does not name (a shard written when the
process died before the manifest named it, a temporary file) is not part of the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from distill_common import wire
from distill_common.outputs import OutputRequest, TeacherFacts
from distill_common.proto.teacher.v1 import teacher_pb2 as pb

FORMAT = "teacher-outputs/1"
MANIFEST = "manifest.json"
HEAD_FILE = "head.safetensors"
ROW_KEY = "row_key"
LOCK_FILE = ".lock"


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


# ---- files written atomically --------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, or `path` unchanged: a temporary file, synced, renamed, the directory synced."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as handle:
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
    from several ranks)."""
    import fcntl

    with open(Path(directory) / LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def serialize_shard(tensors: dict[str, torch.Tensor]) -> bytes:
    """A shard's bytes: the same tensors always give the same bytes (a resumed dump's shards equal
    an uninterrupted one's)."""
    from safetensors.torch import save

    return save({name: tensor.contiguous() for name, tensor in sorted(tensors.items())}, metadata={"format": FORMAT})


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
    from google.protobuf import json_format

    return TeacherFacts.from_info(json_format.ParseDict(value, pb.TeacherInfo()))


def spec_to_json(spec: pb.OutputSpec) -> dict:
    return _message_to_json(spec)


def spec_from_json(value: dict) -> pb.OutputSpec:
    from google.protobuf import json_format

    return json_format.ParseDict(value, pb.OutputSpec())


def _message_to_json(message) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreCorrupt(f"{path}: not a readable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreCorrupt(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                           f"this version reads {FORMAT!r}")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> None:
    write_atomic(Path(directory) / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
