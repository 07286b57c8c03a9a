"""The student side: the client that reaches a teacher, and a distillation trainer built on it."""

from distill_common.outputs import (Argmax, AttentionInputs, AuxHiddenStates, FinalHidden, HiddenStates, Logits,
                                    NextTokenLogprobs, OutputHead, ProjectedNext, ScoredLogprobs, SortedProbs,
                                    SpanLogprobs, SubsetLogits, TeacherOutput, TopK)
from student_trainer.client import TeacherClient, TeacherInfo
from student_trainer.errors import TeacherError

__all__ = ["TeacherClient", "TeacherInfo", "TeacherOutput", "TeacherError", "Logits", "TopK", "HiddenStates",
           "FinalHidden", "AttentionInputs", "OutputHead", "SubsetLogits", "AuxHiddenStates", "Argmax",
           "NextTokenLogprobs", "ScoredLogprobs", "SpanLogprobs", "ProjectedNext", "SortedProbs"]
