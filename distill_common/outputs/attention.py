"""The attention-input kind: the queries, keys and values some layers of the teacher compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from distill_common.outputs.base import (BatchOutputs, ForwardNeeds, Output, OutputSpecError, TeacherFacts,
                                         TeacherOutput, TensorSpec, _few)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


@dataclass(frozen=True)
class AttentionInputs(Output):
    """Queries, keys and values of some decoder layers (0-based), as each layer hands them to its
    attention function: after the rotary embedding, key/value heads grouped as the model has
    them (distill_common/attention_inputs.py). Sent as three stacks in the order asked:
    q [len(layers), B, S, query_width], k [..., key_width], v [..., value_width]."""

    layers: tuple[int, ...]
    asked_as: ClassVar[str] = "attention layers"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "AttentionInputs | None":
        return cls(tuple(spec.attention_layers)) if spec.attention_layers else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.attention_layers.extend(self.layers)

    def check(self, teacher: TeacherFacts) -> None:
        if teacher.attention.unavailable:
            raise OutputSpecError(f"the teacher cannot send attention inputs: {teacher.attention.unavailable}")
        bad = [layer for layer in self.layers if not 0 <= layer < teacher.num_layers]
        if bad:
            raise OutputSpecError(f"attention layers {_few(bad)} are out of range: the teacher has "
                                  f"{teacher.num_layers} decoder layers, so use 0 .. {teacher.num_layers - 1}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"attention layers {_few(list(self.layers))} repeat a layer: ask for each once")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(attention_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        widths = (teacher.attention.query_width, teacher.attention.key_width, teacher.attention.value_width)
        return [TensorSpec((len(self.layers), batch, seq, width), dtype) for width in widths]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.stack([forward.attention[layer][part] for layer in self.layers]).to(dtype).contiguous()
                for part in range(3)]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        queries, keys, values = tensors
        return {"attention_inputs": {layer: (queries[i], keys[i], values[i]) for i, layer in enumerate(self.layers)}}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [torch.stack([out.attention_inputs[layer][part] for layer in self.layers]) for part in range(3)]

    def __str__(self) -> str:
        return f"attention_layers={self.layers}"
