"""What a teacher's decoder runs in when it is not its dtype (TeacherInfo.quantization), shared by the
teacher (teacher_server/fp8.py makes it so), the student (which may refuse it) and the admin
command (which prints it). No torch here: `teacher-server info` imports this."""

from __future__ import annotations

from dataclasses import dataclass

from distill_common.proto.teacher.v1 import teacher_pb2 as pb

FP8_E4M3 = "fp8_e4m3"


@dataclass(frozen=True)
class Quantization:
    """What the teacher's decoder runs in, as TeacherInfo says it: empty when it runs in its dtype."""

    format: str = ""  # "fp8_e4m3", or "" (the model's dtype throughout)
    scaling: str = ""  # "row" or "block" (SCALINGS)
    source: str = ""  # "quantized at load" (--quantize fp8) or "checkpoint" (published FP8 weights)
    full_precision_layers: tuple[int, ...] = ()  # decoder layers left in the model's dtype
    fast_accumulation: bool = False  # row products without float32 promotion along K (--fp8-fast-accum)

    @classmethod
    def from_info(cls, info: pb.QuantizationInfo) -> "Quantization":
        return cls(format=info.format, scaling=info.scaling, source=info.source,
                   full_precision_layers=tuple(info.full_precision_layers),
                   fast_accumulation=info.fast_accumulation)

    def to_info(self) -> pb.QuantizationInfo:
        return pb.QuantizationInfo(format=self.format, scaling=self.scaling, source=self.source,
                                   full_precision_layers=list(self.full_precision_layers),
                                   fast_accumulation=self.fast_accumulation)

    def __str__(self) -> str:
        if not self.format:
            return "none"
        kept = (f", decoder layers {','.join(map(str, self.full_precision_layers))} in the model's dtype"
                if self.full_precision_layers else "")
        scales = "per-row activation, per-channel weight" if self.scaling == "row" else \
            "1x128 activation, 128x128 weight"
        fast = "; fast accumulation" if self.fast_accumulation else ""
        return f"{self.format} linears ({scales} scales; {self.source}{fast}){kept}"
