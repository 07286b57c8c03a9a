"""What a teacher's decoder runs in when it is not its dtype (TeacherInfo.quantization), shared by the
teacher (teacher_server/fp8.py makes it so), the student (which may refuse it) and the admin
command (which prints it). No torch here: `teacher-server info` imports this."""

from __future__ import annotations

from dataclasses import dataclass, field

from distill_common.proto.teacher.v1 import teacher_pb2 as pb

FP8_E4M3 = "fp8_e4m3"


@dataclass(frozen=True)
class Quantization:
    """What the teacher's decoder runs in, as TeacherInfo says it: empty when it runs in its dtype.

    Two quantizations are equal when they compute the same thing (format, scales, what runs in
    the model's dtype, bias correction); the measured figures are not compared: a restarted
    teacher measures them again, and a student that rejoins it is told what changed only when
    its numerics did."""

    format: str = ""  # "fp8_e4m3", or "" (the model's dtype throughout)
    scaling: str = ""  # "row" or "block" (SCALINGS)
    source: str = ""  # "quantized at load" (--quantize fp8) or "checkpoint" (published FP8 weights)
    full_precision_layers: tuple[int, ...] = ()  # decoder layers left in the model's dtype
    fast_accumulation: bool = False  # row products without float32 promotion along K (--fp8-fast-accum)
    full_precision_linears: tuple[str, ...] = ()  # single linears left in the model's dtype (module names)
    bias_correction: bool = False  # each FP8 linear's bias holds its weight error on the calibration mean input
    fp8_flop_share: float = field(default=0.0, compare=False)  # of the decoder linears' multiply-adds per token
    # Measured at start-up against the model in its dtype (teacher_server/fp8_calibration.py); 0 tokens: not measured.
    calibration_tokens: int = field(default=0, compare=False)
    kl_mean: float = field(default=0.0, compare=False)  # nats per token, KL(dtype || FP8)
    kl_p99: float = field(default=0.0, compare=False)
    top1_agreement: float = field(default=0.0, compare=False)
    max_kl: float = field(default=0.0, compare=False)  # --fp8-max-kl (0: none)

    @property
    def measured(self) -> bool:
        return self.calibration_tokens > 0

    @classmethod
    def from_info(cls, info: pb.QuantizationInfo) -> "Quantization":
        return cls(format=info.format, scaling=info.scaling, source=info.source,
                   full_precision_layers=tuple(info.full_precision_layers),
                   fast_accumulation=info.fast_accumulation,
                   full_precision_linears=tuple(info.full_precision_linears), bias_correction=info.bias_correction,
                   fp8_flop_share=info.fp8_flop_share, calibration_tokens=info.calibration_tokens,
                   kl_mean=info.kl_mean, kl_p99=info.kl_p99, top1_agreement=info.top1_agreement, max_kl=info.max_kl)

    def to_info(self) -> pb.QuantizationInfo:
        return pb.QuantizationInfo(format=self.format, scaling=self.scaling, source=self.source,
                                   full_precision_layers=list(self.full_precision_layers),
                                   fast_accumulation=self.fast_accumulation,
                                   full_precision_linears=list(self.full_precision_linears),
                                   bias_correction=self.bias_correction, fp8_flop_share=self.fp8_flop_share,
                                   calibration_tokens=self.calibration_tokens, kl_mean=self.kl_mean,
                                   kl_p99=self.kl_p99, top1_agreement=self.top1_agreement, max_kl=self.max_kl)

    def above(self, max_kl: float) -> str:
        """Why this teacher's measured cost is not within `max_kl` nats per token, or ""."""
        if not self.format:
            return ""
        if not self.measured:
            return f"its decoder runs in {self.format} ({self.source}) and it did not measure what that costs it"
        if self.kl_mean > max_kl:
            return (f"its decoder in {self.format} costs it a KL of {self.kl_mean:.3g} nats per token to its own dtype "
                    f"(measured at start-up on {self.calibration_tokens} tokens)")
        return ""

    def cost(self) -> str:
        """What FP8 costs the teacher, as measured at its start-up."""
        if not self.measured:
            return "not measured"
        bound = f" (bound {self.max_kl:g})" if self.max_kl else ""
        return (f"KL {self.kl_mean:.2e} nats per token{bound}, p99 {self.kl_p99:.2e}, top-1 agreement "
                f"{self.top1_agreement:.1%} on {self.calibration_tokens} calibration tokens")

    def __str__(self) -> str:
        if not self.format:
            return "none"
        kept = (f", decoder layers {','.join(map(str, self.full_precision_layers))} in the model's dtype"
                if self.full_precision_layers else "")
        if self.full_precision_linears:
            kept += f", {len(self.full_precision_linears)} linears in the model's dtype"
        scales = "per-row activation, per-channel weight" if self.scaling == "row" else \
            "1x128 activation, 128x128 weight"
        fast = "; fast accumulation" if self.fast_accumulation else ""
        corrected = "; bias-corrected" if self.bias_correction else ""
        share = f"; {self.fp8_flop_share:.0%} of the linear FLOPs in FP8" if self.fp8_flop_share else ""
        return f"{self.format} linears ({scales} scales; {self.source}{fast}{corrected}){kept}{share}; {self.cost()}"
