"""Hidden-state kinds: layers asked by index, the final (normed) hidden state with the output head,
and the three auxiliary layers an EAGLE-3 draft head reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from distill_common.outputs.base import (BatchOutputs, ForwardNeeds, JoinData, Output, OutputHead,
                                         OutputSpecError, TeacherFacts, TeacherOutput, TensorSpec, _few)
from distill_common.proto.teacher.v1 import teacher_pb2 as pb


@dataclass(frozen=True)
class HiddenStates(Output):
    """Hidden states of some layers (HF output_hidden_states indexing: 0 is the embeddings,
    i is after layer i), sent stacked as [len(layers), B, S, H] in the order asked."""

    layers: tuple[int, ...]
    asked_as: ClassVar[str] = "hidden layers"

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))  # any sequence given: hashable all the same

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "HiddenStates | None":
        return cls(tuple(spec.hidden_layers)) if spec.hidden_layers else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.hidden_layers.extend(self.layers)

    def check(self, teacher: TeacherFacts) -> None:
        bad = [layer for layer in self.layers if not 0 <= layer <= teacher.num_layers]
        if bad:
            raise OutputSpecError(f"hidden layers {_few(bad)} are out of range: the teacher has {teacher.num_layers} "
                                  f"layers, so use 0 (embeddings) .. {teacher.num_layers}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"hidden layers {_few(list(self.layers))} repeat a layer: ask for each once")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(hidden_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((len(self.layers), batch, seq, teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.stack([forward.hidden[layer] for layer in self.layers]).to(dtype).contiguous()]

    def assemble(self, tensors: list[torch.Tensor]) -> dict:
        (stacked,) = tensors
        return {"hidden_states": {layer: stacked[i] for i, layer in enumerate(self.layers)}}

    def disassemble(self, out: TeacherOutput) -> list[torch.Tensor]:
        return [torch.stack([out.hidden_states[layer] for layer in self.layers])]

    def __str__(self) -> str:
        return f"hidden_layers={self.layers}"


@dataclass(frozen=True)
class FinalHidden(Output):
    """The output head's input [B, S, H] (the final normed hidden state), and the head itself
    once at join, so that the student computes the teacher's logits (student_trainer/losses.py:
    `kd_loss_from_hidden`): vocab / hidden times fewer bytes per token than the logits, and no
    [B, S, V] teacher tensor on either side. The student finds the head in `TeacherClient.joined.head`."""

    asked_as: ClassVar[str] = "final_hidden"
    fields: ClassVar[tuple[str, ...]] = ("final_hidden",)
    same_vocabulary: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "FinalHidden | None":
        return cls() if spec.final_hidden else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.final_hidden = True

    def check(self, teacher: TeacherFacts) -> None:
        if teacher.head.unavailable:
            raise OutputSpecError(f"the teacher cannot send its output head to apply on the student: "
                                  f"{teacher.head.unavailable}; distil from its logits or top-k instead")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(final_hidden=True)

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [forward.final_hidden.to(dtype).contiguous()]

    def join_layout(self, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        weight = TensorSpec((teacher.vocab_size, teacher.hidden_size), dtype)
        return [weight, TensorSpec((teacher.vocab_size,), dtype)] if teacher.head.bias else [weight]

    def join_derive(self, source: JoinData, dtype: torch.dtype) -> list[torch.Tensor]:
        head = source.head
        return [t.to(dtype).contiguous() for t in (head.weight, head.bias) if t is not None]

    def join_assemble(self, tensors: list[torch.Tensor], teacher: TeacherFacts) -> dict:
        weight, *bias = tensors
        return {"head": OutputHead(weight, bias[0] if bias else None,
                                   final_logit_softcapping=teacher.head.final_logit_softcapping,
                                   logit_scale=teacher.head.logit_scale)}

    def __str__(self) -> str:
        return "final_hidden"


# How many layers an EAGLE-3 draft's projection reads (fc: 3 x hidden -> hidden in vLLM, SGLang, SpecForge).
AUX_LAYERS = 3


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers vLLM (`get_eagle3_aux_hidden_state_layers`), SGLang (`set_eagle3_layers_to_capture`)
    and the EAGLE-3 reference (traineagle3/modeling_llama_kv.py) capture: the input of layers 2,
    L // 2 and L - 3, which is HF output_hidden_states index 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class AuxHiddenStates(Output):
    """Three layers' hidden states concatenated along the hidden dimension, [B, S, 3H] (HF
    output_hidden_states indexing, in the order asked); no layers: the reference default for
    the teacher's depth (`default_aux_layers`)."""

    layers: tuple[int, ...] = ()
    asked_as: ClassVar[str] = "aux_hidden_states"
    fields: ClassVar[tuple[str, ...]] = ("aux_hidden_states",)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(layer) for layer in self.layers))

    @classmethod
    def from_spec(cls, spec: pb.OutputSpec) -> "AuxHiddenStates | None":
        return cls(tuple(spec.aux_hidden_states.layers)) if spec.HasField("aux_hidden_states") else None

    def to_spec(self, spec: pb.OutputSpec) -> None:
        spec.aux_hidden_states.SetInParent()  # present even with no layers: "the default ones"
        spec.aux_hidden_states.layers.extend(self.layers)

    def for_teacher(self, teacher: TeacherFacts) -> "AuxHiddenStates":
        if self.layers:
            return self
        layers = default_aux_layers(teacher.num_layers)
        if teacher.num_layers < 7:  # below 7 the three default layers are not distinct and in range
            raise OutputSpecError(
                f"aux_hidden_states: the default layers (2, L // 2, L - 3) need a teacher of at least 7 layers, this "
                f"one has {teacher.num_layers} (they would be {layers}); name three layers in 0 .. "
                f"{teacher.num_layers}, e.g. {tuple(sorted({0, teacher.num_layers // 2, teacher.num_layers}))}")
        return AuxHiddenStates(layers)

    def check(self, teacher: TeacherFacts) -> None:
        if len(self.layers) != AUX_LAYERS:
            raise OutputSpecError(f"aux_hidden_states asks for {len(self.layers)} layers {_few(list(self.layers))}: an "
                                  f"EAGLE-3 draft reads exactly {AUX_LAYERS} (low, middle, high), or none for the "
                                  "teacher's default ones")
        bad = [layer for layer in self.layers if not 0 <= layer <= teacher.num_layers]
        if bad:
            raise OutputSpecError(f"aux_hidden_states layers {bad} are out of range: the teacher has "
                                  f"{teacher.num_layers} layers, so use 0 (embeddings) .. {teacher.num_layers}")
        if len(set(self.layers)) != len(self.layers):
            raise OutputSpecError(f"aux_hidden_states layers {list(self.layers)} repeat a layer: name three "
                                  "different ones")

    @property
    def needs(self) -> ForwardNeeds:
        return ForwardNeeds(hidden_layers=frozenset(self.layers))

    def layout(self, batch: int, seq: int, teacher: TeacherFacts, dtype: torch.dtype) -> list[TensorSpec]:
        return [TensorSpec((batch, seq, len(self.layers) * teacher.hidden_size), dtype)]

    def derive(self, forward: BatchOutputs, batch, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.cat([forward.hidden[layer].to(dtype) for layer in self.layers], dim=-1).contiguous()]

    def __str__(self) -> str:
        return f"aux_hidden_states={self.layers}"
