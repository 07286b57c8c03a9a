"""A session group's transport over a real two-rank gloo group (distill_common/session_group.py):
what the teacher derives arrives on the student as the request lays it out."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from distill_common.outputs import BatchOutputs, HiddenStates, Logits, OutputRequest, TeacherFacts, TopK, output_spec
from distill_common.session_group import STUDENT_RANK, TEACHER_RANK, build_group, handshake, prefix_token


def test_outputs_cross_a_real_gloo_group_as_the_request_lays_them_out():
    """Teacher: derive, `to_send`, `send_all`; student: `post_receives` from the layout alone,
    then `delivered`, then assemble. What arrives is what the teacher derived, in wire order."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    spec = output_spec([Logits(), TopK(3), HiddenStates((2, 0))], "float16")
    facts = TeacherFacts(vocab_size=11, hidden_size=6, num_layers=2, dtype=torch.float32)
    request = OutputRequest.resolve(spec, facts)
    forward = BatchOutputs(torch.randn(2, 5, 11), {layer: torch.randn(2, 5, 6) for layer in range(3)})
    batches = 2  # a second batch on the same group: the order holds from one batch to the next
    received, errors = [], []

    def side(rank: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=10))
            group = build_group(store, "transport-test", backend="gloo", rank=rank, device=torch.device("cpu"),
                                timeout_s=10.0, gloo_host="127.0.0.1")
            try:
                handshake(group, prefix_token("transport-test"), 10.0)
                for batch_id in range(batches):
                    if rank == TEACHER_RANK:
                        tensors = group.to_send(request.derive(forward, batch=None))
                        assert all(t.device.type == "cpu" for t in tensors)  # gloo sends host memory
                        for work in group.send_all(tensors):
                            group.wait(work, what=f"sending batch {batch_id}")
                    else:
                        buffers, works = group.post_receives(request.layout(2, 5))
                        for work in works:
                            group.wait(work, what=f"receiving batch {batch_id}")
                        received.append(request.assemble(batch_id, group.delivered(buffers)))
            finally:
                group.abort()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=side, args=(rank,)) for rank in (TEACHER_RANK, STUDENT_RANK)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert [out.batch_id for out in received] == list(range(batches))
    for out in received:
        assert torch.equal(out.logits, forward.logits.half())
        values, indices = torch.topk(forward.logits, 3, dim=-1)
        assert torch.equal(out.topk_values, values.half()) and torch.equal(out.topk_indices, indices.int())
        assert list(out.hidden_states) == [2, 0]
        assert all(torch.equal(out.hidden_states[layer], forward.hidden[layer].half()) for layer in (2, 0))
