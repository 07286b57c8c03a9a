"""The OpenAI API's answer memory (teacher_server/openai/budget.py): the bound each request is
charged holds what it writes, and the budget shares room max-min between jobs, in order within
one, with bounded waits that give nothing away when they end. The served side (a request too
large refused, the bytes back after answers) is in tests/test_openai_api.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from teacher_server.openai.budget import (JSON_COPIES, AnswerBudget, AnswerBudgetBusy, AnswerTooLarge, FairPool,
                                          answer_bytes, entry_bytes)
from teacher_server.openai.protocol import TokenText, parse_completion, write_prompt_logprobs


class _Tokenizer:
    """Token texts of every length and escaping JSON has: quotes, backslashes, control and
    non-ASCII characters (written as \\uXXXX), up to 40 characters."""

    def __init__(self, vocab: int):
        alphabet = ['"', "\\", "\n", "\x01", "é", "漢", "a", " "]
        self.texts = ["".join(alphabet[(i + j) % len(alphabet)] for j in range(i % 41)) for i in range(vocab)]

    def __len__(self) -> int:
        return len(self.texts)

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [self.texts[row[0]] for row in ids]


def _worst_values(rng, shape) -> np.ndarray:
    """float32 log-probabilities whose reprs are long (subnormal-free tiny negatives, 17 digits)."""
    return -(rng.random(shape, dtype=np.float32) * np.float32(1e-5) + np.float32(1.1754944e-38))


@pytest.mark.parametrize("scored", [False, True])
def test_the_charge_bounds_the_json_written(scored):
    vocab, k = 5000, 7
    text = TokenText(_Tokenizer(vocab), vocab)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in (2, 17, 40)]
    body = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": k}
    if scored:
        body["prompt_logprob_token_ids"] = [[rng.integers(0, vocab, size=3).tolist()] * (len(p) - 1) for p in prompts]
    params = parse_completion(body, vocab_size=vocab, max_logprobs=k, max_prompts=8)
    size = entry_bytes(text)
    charged = answer_bytes(params, vocab_size=vocab, entry_size=size)
    written = 0
    for index, prompt in enumerate(prompts):
        positions = len(prompt)
        top_ids = rng.integers(vocab - 10, vocab, size=(positions, k))  # the vocabulary's longest texts
        values = None
        ids = None
        if scored:
            values = _worst_values(rng, (positions, 3))
            ids = np.full((positions, 3), -1, dtype=np.int64)
            ids[:positions - 1] = np.asarray(body["prompt_logprob_token_ids"][index])
            ids = ids.tolist()
        out = write_prompt_logprobs(prompt, _worst_values(rng, (positions, k)), top_ids,
                                    _worst_values(rng, positions), rng.integers(vocab - 1, vocab + 1, size=positions),
                                    values, ids, text)
        json.loads(out)
        written += len(out.encode())
    rows = len(prompts) * vocab * 4  # the distributions kept to sample the one token from
    assert JSON_COPIES * written <= charged - rows
    assert charged - rows < 4 * JSON_COPIES * written  # a bound, not a blanket


def test_one_token_prompts_are_charged_their_distributions():
    vocab = 32000
    params = parse_completion({"prompt": [[1]] * 1000, "max_tokens": 1}, vocab_size=vocab, max_logprobs=20,
                              max_prompts=16384)
    charged = answer_bytes(params, vocab_size=vocab, entry_size=entry_bytes(TokenText(None, vocab)))
    assert charged >= 1000 * vocab * 4


def _run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_request_larger_than_the_budget_is_refused_saying_what_to_change():
    async def scenario():
        with pytest.raises(AnswerTooLarge, match="--api-max-answer-bytes"):
            await AnswerBudget(100).reserve("a", 101)

    _run(scenario)


def test_requests_wait_for_room_in_order_within_a_job_and_max_min_between_jobs():
    async def scenario():
        budget = AnswerBudget(100)
        keep, first = await budget.reserve("a", 20), await budget.reserve("a", 80)
        order, leases = [], {}

        async def ask(job, size):
            leases[job, size] = await budget.reserve(job, size)
            order.append((job, size))

        async def settle():
            for _ in range(3):
                await asyncio.sleep(0)

        # Job a's flood queued first, then one request of job b.
        tasks = [asyncio.create_task(ask("a", size)) for size in (50, 40, 30)]
        await settle()
        tasks.append(asyncio.create_task(ask("b", 50)))
        await settle()
        assert order == [] and budget.waiting == 4 and budget.held == 100
        first.release()
        first.release()  # a second release gives nothing back twice
        await settle()
        # b holds nothing and a 20: b goes first, though it came last; a's 50 does not fit beside it.
        assert order == [("b", 50)] and budget.held == 70
        keep.release()
        await settle()
        assert order == [("b", 50), ("a", 50)] and budget.held == 100
        leases["b", 50].release()
        leases["a", 50].release()
        await asyncio.gather(*tasks)
        assert order == [("b", 50), ("a", 50), ("a", 40), ("a", 30)]  # a's own in the order they came
        leases["a", 40].release()
        leases["a", 30].release()
        assert budget.held == 0 and budget.waiting == 0 and not budget._held

    _run(scenario)


def test_a_wait_ends_after_its_timeout_and_a_cancelled_wait_keeps_nothing():
    async def scenario():
        budget = AnswerBudget(100, timeout_s=0.2)
        held = await budget.reserve("a", 90)
        started = asyncio.get_running_loop().time()
        with pytest.raises(AnswerBudgetBusy, match="retry later"):
            await budget.reserve("b", 50)
        assert 0.15 < asyncio.get_running_loop().time() - started < 5
        assert budget.waiting == 0 and budget.held == 90
        # A large request gives up at the head: the small one behind it, which fits, goes then.
        budget.timeout_s = 5
        large = asyncio.create_task(budget.reserve("b", 50))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(budget.reserve("c", 10))
        await asyncio.sleep(0.01)
        assert not small.done()  # behind the large one, though it would fit
        large.cancel()
        lease = await small
        assert budget.held == 100
        # A wait cancelled in the same turn as its bytes came gives them back.
        waiting = asyncio.create_task(budget.reserve("d", 100))
        await asyncio.sleep(0.01)
        held.release()
        lease.release()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert budget.held == 0 and budget.waiting == 0
        final = await budget.reserve("e", 100)
        final.release()

    _run(scenario)


def test_a_pool_of_one_passes_its_turn_round_the_waiting_jobs():
    """The JSON writer's turns: job a's queue of answers delays job b's by one answer."""
    async def scenario():
        turns = FairPool(1, timeout_s=5)
        first = await turns.acquire("x", 1)
        order = []

        async def turn(job, name):
            lease = await turns.acquire(job, 1)
            order.append(name)
            await asyncio.sleep(0)
            lease.release()

        tasks = [asyncio.create_task(turn("a", f"a{i}")) for i in range(3)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(turn("b", f"b{i}")) for i in range(2)]
        await asyncio.sleep(0)
        first.release()
        await asyncio.gather(*tasks)
        assert order == ["a0", "b0", "a1", "b1", "a2"]

    _run(scenario)


def test_a_job_holding_something_is_not_starved_by_one_that_drops_to_nothing():
    """Max-min alone would always pick job y (holding 0 at each release) over job x (holding 10):
    x's request goes once it has let MAX_PASSES of y's go, as soon as there is room."""
    from teacher_server.openai.budget import MAX_PASSES

    async def scenario():
        pool = FairPool(100, timeout_s=5)
        held = await pool.acquire("x", 10)
        y_served = []
        holding = 0  # y's leases its clients have seen granted and not released
        x_done = asyncio.Event()

        async def y_client():
            nonlocal holding
            while not x_done.is_set():
                lease = await pool.acquire("y", 50)
                y_served.append(len(y_served))
                holding += 1
                await asyncio.sleep(0.001)
                holding -= 1
                lease.release()

        clients = [asyncio.create_task(y_client()) for _ in range(2)]
        await asyncio.sleep(0.005)
        # y's grants so far: those its clients saw, and any granted whose client has not run yet
        # (counting only the first let one such grant pass as x's on a busy machine: 5 == 4).
        before = len(y_served) + pool._held.get("y", 0) // 50 - holding
        lease = await pool.acquire("x", 80)  # without the passes: TimeoutError after 5 s
        x_done.set()
        served_while_x_waited = len(y_served) - before
        lease.release()
        held.release()
        await asyncio.gather(*clients)
        assert served_while_x_waited == MAX_PASSES
        assert pool.held == 0 and pool.waiting == 0

    _run(scenario)
