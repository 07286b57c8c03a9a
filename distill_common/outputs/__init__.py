"""Teacher outputs: each kind a session can ask for is one class.

A kind (`Output`) says, in one place:

- how a session asks for it: `from_spec` reads its field(s) of the proto `OutputSpec`,
  `to_spec` writes them;
- what the teacher checks at join: `check` raises `OutputSpecError` when this model cannot
  give it, and `same_vocabulary` says whether the student must share the teacher's tokenizer;
- what the forward must produce for it (`needs`, a `ForwardNeeds`);
- its tensors for one `[batch, seq]` input (`layout`), which the student preallocates;
- how the teacher derives them from the forward of one batch (`derive`);
- how the student turns them into fields of a `TeacherOutput` (`assemble`);
- what it sends once, at join (`join_layout`, `join_derive`, `join_assemble`; most kinds nothing).

Its place in the wire order is its place in `KINDS`. A session's `OutputRequest` is the kinds
it asked for, resolved against one teacher: frozen and hashable, so sessions that ask the same
share what the teacher derives. The engine and the client call only the request's methods;
neither names a kind.

Per-batch data. What a kind needs from the student with every batch (ids to score, say) is a
field of `SubmitRequest` named by the kind's `batch_field`: the student's `write_batch` checks
and encodes it, the teacher's `read_batch` validates it at Submit (`BatchDataError`, the
client gets `INVALID_ARGUMENT`), and `derive` finds it in `batch.data[batch_field]`. Batches
that carry such data are derived for themselves: two sessions whose batches share a forward
(the same ids and mask) but not their data are each sent their own tensors.

Join-time data. What a kind needs from the student once (a token subset, say) is a field of
its `OutputSpec`, read in `from_spec` and checked in `check` like `TopK.k`. What it needs from
the teacher once (the weights of its output head, say) is too large for the control plane: it
crosses the session group once, right after the handshake and before any batch. The kind says
what (`join_layout`: the student preallocates it), takes it from the teacher's `JoinData`
(`join_derive`: `JoinData` holds what the teacher's model offers once, gathered whole under
tensor parallelism) and turns the received tensors into fields of the student's `JoinData`
(`join_assemble`: `TeacherClient.joined`). Both ends call the request's `join_*` methods right
after `handshake` (teacher_server/delivery.py, student_trainer/client.py); a kind with nothing
to send at join keeps the defaults, which send nothing. What a kind leaves to the teacher
(`AuxHiddenStates`' default layers, which depend on its depth) is filled in by `for_teacher`
before the check, on both sides alike, so the student's granted request holds the same layers
as the teacher's.

The package's modules: `base` (the facts, the data and `Output`, which every kind implements),
`logits`, `hidden`, `attention`, `logprobs` and `cross_tokenizer` (the kinds, by family), and
`request` (`KINDS`, `output_spec`, `OutputRequest`). Every name is imported from here.
"""

from distill_common.outputs.attention import AttentionInputs
from distill_common.outputs.base import (AttentionFacts, BatchDataError, BatchOutputs, ForwardNeeds, HeadFacts,
                                         JoinData, Output, OutputHead, OutputSpecError, TeacherFacts, TeacherOutput,
                                         TensorSpec, VocabularyMismatch)
from distill_common.outputs.cross_tokenizer import (ALIGNMENT, CrossTokenizerKind, ProjectedNext, SortedProbs,
                                                    SpanLogprobs)
from distill_common.outputs.hidden import AUX_LAYERS, AuxHiddenStates, FinalHidden, HiddenStates, default_aux_layers
from distill_common.outputs.logits import Argmax, Logits, SubsetLogits, TopK
from distill_common.outputs.logprobs import (MIN_LOGPROB_TEMPERATURE, SCORE_ID_DTYPES, NextTokenLogprobs,
                                             ScoredLogprobs)
from distill_common.outputs.request import KINDS, OutputRequest, output_spec

__all__ = [
    "ALIGNMENT", "AUX_LAYERS", "KINDS", "MIN_LOGPROB_TEMPERATURE", "SCORE_ID_DTYPES", "Argmax", "AttentionFacts",
    "AttentionInputs", "AuxHiddenStates", "BatchDataError", "BatchOutputs", "CrossTokenizerKind", "FinalHidden",
    "ForwardNeeds", "HeadFacts", "HiddenStates", "JoinData", "Logits", "NextTokenLogprobs", "Output", "OutputHead",
    "OutputRequest", "OutputSpecError", "ProjectedNext", "ScoredLogprobs", "SortedProbs", "SpanLogprobs",
    "SubsetLogits", "TeacherFacts", "TeacherOutput", "TensorSpec", "TopK", "VocabularyMismatch", "default_aux_layers",
    "output_spec",
]
