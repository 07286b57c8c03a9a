"""The OpenAI API's requests cancelled mid-way (their client gone), on a real engine and model:
a request's batches left queued keep their --max-inflight slots until the engine has settled
them (teacher_server/openai/jobs.py), so a client that leaves and comes back, or whose requests
time out, cannot queue more than --max-inflight batches per session; a request cancelled while a thread joins its answer
ends only when the thread has let go of it (routes.Completions.complete), so its charge is not
given back early. Gates hold the model's own forward and the join for as long as a test needs."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from distill_common.outputs import OutputRequest, TeacherFacts
from teacher_server.engine import Engine
from teacher_server.metrics import Metrics
from teacher_server.model_runner import ModelRunner
from teacher_server.openai.jobs import ApiJobs
from teacher_server.openai.outputs import NEXT_IDS, CompletionLogprobs
from teacher_server.openai.protocol import parse_completion
from teacher_server.openai.routes import Completions

MAX_INFLIGHT = 2


@pytest.fixture
def served():
    """(runner, engine, jobs, facts, gate): the engine's forwards wait for `gate`."""
    runner = ModelRunner("builtin:tiny", "cpu")
    gate = threading.Event()
    forward = runner.forward

    def gated(*args, **kwargs):
        assert gate.wait(30), "the test never opened the gate"
        return forward(*args, **kwargs)

    runner.forward = gated
    engine = Engine(runner, Metrics(runner.device), advertise_host="127.0.0.1", max_batch_tokens=1024,
                    max_sessions=4, lease_s=60, join_timeout_s=10, transfer_timeout_s=60, isolate_sessions=False)
    engine.start()
    jobs = ApiJobs(engine, max_inflight=MAX_INFLIGHT, timeout_s=60)
    config = runner.model.config
    facts = TeacherFacts(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                         num_layers=config.num_hidden_layers, dtype=torch.float32)
    try:
        yield runner, engine, jobs, facts, gate
    finally:
        gate.set()
        jobs.close()
        engine.stop()


def test_a_cancelled_requests_batches_keep_their_slots_until_the_engine_settles_them(served):
    runner, engine, jobs, facts, gate = served
    request = OutputRequest((CompletionLogprobs(prompt_k=2, last=False),), torch.float32, facts)
    ids = torch.tensor([[5, 17, 99, 3]])

    def submit():
        return jobs.submit("job", request, ids, torch.ones_like(ids), {NEXT_IDS: torch.tensor([[17, 99, 3, 0]])})

    async def scenario():
        gone = [asyncio.ensure_future(submit()) for _ in range(5)]  # 2 submitted, 3 waiting for a slot
        for _ in range(200):
            session = next((s for s in engine.sessions() if s.job_id == "job"), None)
            if session is not None and session.batches_submitted == MAX_INFLIGHT:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert session is not None and session.batches_submitted == MAX_INFLIGHT
        for task in gone:
            task.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        back = [asyncio.ensure_future(submit()) for _ in range(3)]  # the client, back
        await asyncio.sleep(0.2)
        # The cancelled requests' two batches still wait for a forward, holding the two slots.
        assert session.batches_submitted == MAX_INFLIGHT and not any(task.done() for task in back)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(*back), 60)
        assert session.batches_submitted == MAX_INFLIGHT + 3
        with torch.no_grad():
            want = torch.log_softmax(runner.model(ids).logits[0].float(), -1)
        for top, top_ids, own, rank in results:
            torch.testing.assert_close(top[0], want.topk(2).values, atol=1e-5, rtol=0)
            assert top_ids[0].tolist() == want.topk(2).indices.tolist()

    asyncio.run(scenario())


def test_a_request_cancelled_while_its_answer_is_joined_ends_when_the_join_does(served):
    runner, engine, jobs, facts, gate = served
    gate.set()
    completions = Completions(jobs, facts, None, model_id="m", max_seq_len=64, max_batch_tokens=1024,
                              max_logprobs=8, answer_limit_bytes=1 << 30, chunk_tokens=0)
    joining, joined = threading.Event(), threading.Event()
    respond = completions._response

    def held(*args):
        joining.set()
        assert joined.wait(30), "the test never let the join end"
        return respond(*args)

    completions._response = held
    params = parse_completion({"prompt": [[5, 17, 99, 3]], "max_tokens": 1}, vocab_size=facts.vocab_size,
                              max_logprobs=8, max_prompts=8)

    async def scenario():
        task = asyncio.ensure_future(completions.complete(params, ("job", 0, "")))
        assert await asyncio.to_thread(joining.wait, 30)
        task.cancel()
        await asyncio.sleep(0.3)
        assert not task.done()  # the thread still holds the answer: the request is not over
        joined.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        await completions.close()

    asyncio.run(scenario())


def test_a_timed_out_requests_batches_keep_their_slots_too(served):
    runner, engine, _, facts, gate = served
    jobs = ApiJobs(engine, max_inflight=MAX_INFLIGHT, timeout_s=0.3)
    request = OutputRequest((CompletionLogprobs(prompt_k=2, last=False),), torch.float32, facts)
    ids = torch.tensor([[5, 17, 99, 3]])

    def submit():
        return jobs.submit("late", request, ids, torch.ones_like(ids), {NEXT_IDS: torch.tensor([[17, 99, 3, 0]])})

    async def scenario():
        from teacher_server.errors import ServiceError

        for _ in range(3):  # a client whose requests time out, asking again
            outcomes = await asyncio.gather(*(submit() for _ in range(4)), return_exceptions=True)
            assert all(isinstance(e, ServiceError) and "within 0.3 s" in str(e) for e in outcomes), outcomes
        session = next(s for s in engine.sessions() if s.job_id == "late")
        assert session.batches_submitted == MAX_INFLIGHT  # not 12: the first two still hold the slots
        gate.set()
        jobs.timeout_s = 30
        await asyncio.wait_for(submit(), 30)  # once they are settled, a slot is free again

    try:
        asyncio.run(scenario())
    finally:
        jobs.close()


def test_a_long_prompts_next_chunk_waits_in_the_queue_while_the_one_before_runs(served):
    """So that fair share weighs the job against the others' batches between two of its chunks
    (one at a time, a job that never pauses ran a whole batch between any two). The chunks still
    run in order, each on the cache of the ones before: the greedy token is the whole prompt's."""
    runner, engine, jobs, facts, gate = served
    completions = Completions(jobs, facts, None, model_id="m", max_seq_len=64, max_batch_tokens=1024,
                              max_logprobs=8, answer_limit_bytes=1 << 30, chunk_tokens=4)
    prompt = [(7 * i + 5) % 500 for i in range(11)]  # 3 chunks, the last one short
    params = parse_completion({"prompt": [prompt], "max_tokens": 1, "temperature": 0,
                               "return_token_ids": True}, vocab_size=facts.vocab_size, max_logprobs=8, max_prompts=8)

    async def scenario():
        task = asyncio.ensure_future(completions.complete(params, ("chunked", 0, "")))
        session = None
        for _ in range(200):
            session = next((s for s in engine.sessions() if s.job_id == "chunked"), None)
            if session is not None and session.batches_submitted == 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert session is not None and session.batches_submitted == 2  # the first chunk held by the gate
        gate.set()
        body = await asyncio.wait_for(task, 60)
        await completions.close()
        return body

    import json

    answer = json.loads(asyncio.run(scenario()))
    with torch.no_grad():
        want = int(runner.model(torch.tensor([prompt])).logits[0, -1].argmax())
    assert answer["choices"][0]["token_ids"] == [want]


def test_a_chunk_whose_session_was_replaced_waits_for_the_one_before(served):
    """A long prompt's chunks queued in order stay in order when the job's session for their
    outputs is replaced between two of them (here a newer request shape of the job takes its place,
    MAX_SHAPES_PER_JOB): the next chunk, in a new session's queue, waits for the one before rather
    than be planned first and fail on a cache without it."""
    runner, engine, jobs, facts, gate = served
    jobs.MAX_SHAPES_PER_JOB = 2
    engine.scheduler.max_sessions = 8
    shape = lambda k: OutputRequest((CompletionLogprobs(prompt_k=k, last=False),), torch.float32, facts)  # noqa: E731
    chunked, other, newer = shape(2), shape(3), shape(4)
    sequence = torch.tensor([[(7 * i + 5) % 500 for i in range(8)]])
    short = sequence[:, :4]

    def enqueue(job, outputs, ids, chunk=None, after=None):
        return jobs.enqueue(job, outputs, ids, torch.ones_like(ids), {NEXT_IDS: torch.zeros_like(ids)}, chunk=chunk,
                            after=after)

    async def scenario():
        from teacher_server.model_runner import Chunk, Prefix

        gate.set()
        await jobs.served(await enqueue("j", newer, short))
        for _ in range(2):  # the chunked shape's session ahead in fair share: a new one would be planned first
            await jobs.served(await enqueue("j", chunked, short))
        gate.clear()
        held = await enqueue("elsewhere", chunked, short)  # the engine waits in this forward
        await asyncio.sleep(0.3)
        prefix = Prefix()
        first = await enqueue("j", chunked, sequence[:, :4], Chunk(prefix, 0))
        others = [await enqueue("j", newer, short), await enqueue("j", other, short)]  # the chunked session goes
        second = asyncio.ensure_future(enqueue("j", chunked, sequence[:, 4:], Chunk(prefix, 4), after=first))
        await asyncio.sleep(0.3)
        assert not second.done()  # waits for the first chunk, in the replaced session
        gate.set()
        second = await asyncio.wait_for(second, 60)
        assert second.session is not first.session
        for queued in [held, first, *others]:
            await jobs.served(queued)
        return await jobs.served(first), await jobs.served(second)

    (top_first, *_), (top_second, *_) = asyncio.run(scenario())
    with torch.no_grad():
        want = torch.log_softmax(runner.model(sequence).logits[0].float(), -1).topk(2).values
    torch.testing.assert_close(torch.cat([top_first[0], top_second[0]]), want, atol=1e-5, rtol=0)
