"""The teacher in the training process: what a served teacher sends, computed here.

The colocated baseline that the served teacher is measured against (bench/eagle3_colocated.py,
bench/recipe_served.py): the teacher model runs in the student's process, on its GPU, through the
server's own forward (teacher_server/model_runner.py: the probe of its head and attention inputs,
the decoder without the head when no kind needs logits), and each batch's outputs are derived and
assembled by the same output kinds (distill_common/outputs/) a teacher server uses, so a
training loop reads the same `TeacherOutput` (and `joined.head`) either way. `submit` computes at
once and returns a resolved future: there is nothing to overlap with.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from distill_common.outputs import BatchOutputs, Output, OutputRequest, TeacherFacts, output_spec
from distill_common.wire import dtype_name


class LocalTeacher:
    def __init__(self, model, outputs: Iterable[Output], dtype: torch.dtype | None = None):
        """`model`: the teacher, built on the device it runs on. `outputs`: the kinds, as a
        TeacherClient asks them; refused (OutputSpecError) as a server would refuse them."""
        from teacher_server.model_runner import ModelRunner

        device = next(model.parameters()).device
        self.runner = ModelRunner(type(model).__name__, str(device), model=model, outputs_for_autograd=True)
        info = self.runner.info
        self.info = TeacherFacts(vocab_size=info.vocab_size, hidden_size=info.hidden_size,
                                 num_layers=info.num_layers, dtype=info.dtype, head=info.head,
                                 attention=info.attention)
        self.model = self.runner.model
        self.outputs = OutputRequest.resolve(output_spec(outputs, dtype_name(dtype) if dtype else None), self.info)
        # What a session receives once at join (the head, for FinalHidden): the model's own
        # tensors where the dtype is the model's, so it is not held twice.
        self.joined = self.outputs.join_assemble(self.outputs.join_derive(self.runner.join_data))
        self._next_batch_id = 0

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               score_ids: torch.Tensor | None = None) -> Future:
        """As `TeacherClient.submit`: `score_ids` [B, S, k] for ScoredLogprobs."""
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        needs = self.outputs.needs
        forward = self.runner.forward(input_ids, mask, needs)
        produced = BatchOutputs.of_rows(forward, needs, slice(None), input_ids.shape[1])
        del forward  # the other layers' states
        batch = SimpleNamespace(input_ids=input_ids, attention_mask=mask,  # what `derive` reads of a batch
                                data={} if score_ids is None else {"score_ids": score_ids})
        future: Future = Future()
        future.set_result(self.outputs.assemble(self._next_batch_id, self.outputs.derive(produced, batch)))
        self._next_batch_id += 1
        return future
