"""Dense tensors on the control plane (token ids and masks only), dtype names, batch keys.

Token ids travel as raw little-endian bytes with an explicit dtype and shape: no
pickle, no torch.load. Decoding validates every field, because the bytes come from
the network.

A batch's *key* (`batch_key`) is a BLAKE2b digest of the token ids and mask the teacher
computes on: the output cache's key (teacher_server/cache.py) and, in 16 bytes, part of
each batch's header on the data plane (distill_common/session_group.py), which the
student checks against `request_key` of what it sent.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch

from distill_common.proto.teacher.v1 import teacher_pb2 as pb

# Names used in the proto for the dtypes of tensors that cross the control plane.
ID_DTYPES = {"int32": np.int32, "int64": np.int64}
MASK_DTYPES = {"int32": np.int32, "int64": np.int64, "bool": np.bool_}

# The most dimensions a tensor on the control plane may have (token ids have 2, ids to score 3).
MAX_DIMS = 8

# Names for the dtypes of teacher outputs (OutputSpec.dtype, TeacherInfo.dtype).
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WireError(ValueError):
    """A tensor on the wire is malformed; the message says what is wrong."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in OUTPUT_DTYPES.items():
        if candidate == dtype:
            return name
    raise WireError(f"dtype {dtype} is not an output dtype; use one of {sorted(OUTPUT_DTYPES)}")


def parse_output_dtype(name: str) -> torch.dtype:
    try:
        return OUTPUT_DTYPES[name]
    except KeyError:
        raise WireError(f"unknown dtype {name!r}; use one of {sorted(OUTPUT_DTYPES)}") from None


def encode(tensor: torch.Tensor) -> pb.Tensor:
    """A CPU int/bool tensor as a proto Tensor (little-endian, row-major)."""
    array = tensor.detach().cpu().contiguous().numpy()
    if sys.byteorder != "little":
        array = array.byteswap().view(array.dtype.newbyteorder())
    name = {np.dtype(np.int32): "int32", np.dtype(np.int64): "int64", np.dtype(np.bool_): "bool"}.get(array.dtype)
    if name is None:
        raise WireError(f"token ids and masks must be int32, int64 or bool, got {tensor.dtype}")
    return pb.Tensor(dtype=name, shape=list(array.shape), data=array.tobytes())


def decode(message: pb.Tensor, *, what: str, dtypes: dict, max_elements: int) -> torch.Tensor:
    """Validates and decodes a proto Tensor into a CPU torch tensor.

    `what` names the field in error messages; `max_elements` bounds the allocation
    before any byte is interpreted.
    """
    array = _checked_array(message, what=what, dtypes=dtypes, max_elements=max_elements)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))


def decode_ids(message: pb.Tensor, *, what: str, dtypes: dict, max_elements: int) -> np.ndarray:
    """`decode` as an int64 numpy array (one copy): the teacher checks token ids with numpy,
    whose per-call cost on a few thousand ids is a fraction of torch's."""
    return _checked_array(message, what=what, dtypes=dtypes, max_elements=max_elements).astype(np.int64)


def _checked_array(message: pb.Tensor, *, what: str, dtypes: dict, max_elements: int) -> np.ndarray:
    """The message's bytes as a read-only little-endian numpy view of its shape, once checked."""
    if message.dtype not in dtypes:
        raise WireError(f"{what} has dtype {message.dtype!r}; it must be one of {sorted(dtypes)} (token ids are integers)")
    if len(message.shape) > MAX_DIMS:  # numpy holds 64; the shape itself is not quoted: it may be long
        raise WireError(f"{what} has {len(message.shape)} dimensions; tensors on the control plane have at most "
                        f"{MAX_DIMS} (token ids are [batch, seq])")
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise WireError(f"{what} has a negative dimension in shape {shape}")
    count = 1
    for dim in shape:
        count *= dim
        if count > max_elements:
            raise WireError(f"{what} of shape {shape} has more than {max_elements} elements")
    np_dtype = np.dtype(dtypes[message.dtype]).newbyteorder("<")
    if len(message.data) != count * np_dtype.itemsize:
        raise WireError(
            f"{what} has {len(message.data)} bytes but shape {shape} of {message.dtype} needs {count * np_dtype.itemsize}")
    return np.frombuffer(message.data, dtype=np_dtype).reshape(shape)



def batch_key(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> bytes:
    """A content digest of one batch (32 bytes): equal keys mean the same forward inputs.

    Over the tensors' dtype, shape and bytes; never Python's `hash()` (salted per process,
    64 bits) and never pickle.
    """
    digest = hashlib.blake2b(digest_size=32)
    for tensor in (input_ids, attention_mask):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy())  # the buffer itself, not a copy of it
    return digest.digest()


def request_key(input_ids: pb.Tensor, attention_mask: pb.Tensor | None) -> bytes:
    """`batch_key` of the batch the teacher decodes from these SubmitRequest fields (int64 ids
    and mask, a mask of ones when there is none), as the student computes it for the header."""
    ids = torch.from_numpy(decode_ids(input_ids, what="input_ids", dtypes=ID_DTYPES, max_elements=sys.maxsize))
    if attention_mask is None:
        return batch_key(ids, torch.ones_like(ids))
    mask = decode_ids(attention_mask, what="attention_mask", dtypes=MASK_DTYPES, max_elements=sys.maxsize)
    return batch_key(ids, torch.from_numpy(mask))
