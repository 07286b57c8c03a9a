"""vLLM's OpenAI API on the teacher (teacher_server/openai/): TRL's own client against a real
server, every value checked against `log_softmax` of the same model run here."""

from __future__ import annotations

import json
import math
import socket
import time

import pytest
import requests
import torch

from teacher_server.launcher import ServerProcess
from tests.helpers import build_tiny_model, status_sessions, wait_until

VOCAB = 384
OPERATOR = "operator-token-0123456789abcdef"
JOB_TOKEN = "job-token-of-trl-0123456789abcdef"
CHUNK_TOKENS = 8
ANSWER_LIMIT = 64 << 20  # --api-max-answer-bytes: room for every test's requests, not for the one too large
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.\n"] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from distill_demo.tokenizer import train_tokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("openai") / "model", vocab_size=VOCAB)
    tokenizer = train_tokenizer(TEXTS, vocab_size=300, save_dir=path)
    assert len(tokenizer) <= VOCAB
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "jobs.json"
    tokens.write_text(json.dumps({"trl-job": {"token": JOB_TOKEN}}))
    # Forwards of at most 8 tokens: of SEQUENCES, the longest runs in two chunks on the model's KV cache.
    server = ServerProcess("--model", str(model_dir), "--auth-token", OPERATOR, "--job-tokens", str(tokens),
                           "--max-logprobs", "300", "--api-chunk-tokens", str(CHUNK_TOKENS),
                           "--api-max-answer-bytes", str(ANSWER_LIMIT))
    yield server
    server.stop()


def _http(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def _post(server, body: dict, token: str = JOB_TOKEN) -> requests.Response:
    return requests.post(f"{_http(server)}/v1/completions", json=body, timeout=60,
                         headers={"Authorization": f"Bearer {token}"} if token else {})


def _log_softmax(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double() / temperature, -1)


SEQUENCES = [[5, 17, 99, 3, 250, 7, 7, 42], [9, 1, 300, 12, 64], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209]]


def _trl_client(server):
    """TRL's VLLMClient on this teacher. Its __init__ insists that vLLM be installed here (for its
    weight-sync helpers, which scoring does not use): the client is made without it, and every
    method called below is TRL's own."""
    from trl.generation.vllm_client import VLLMClient

    client = object.__new__(VLLMClient)
    client.session = requests.Session()
    client.session.headers["Authorization"] = f"Bearer {JOB_TOKEN}"  # the job this client's requests run as
    client.base_url = _http(server)
    client.host = "127.0.0.1"
    client.check_server(total_timeout=10)
    client.model = client._get(f"{client.base_url}/v1/models")["data"][0]["id"]
    return client


def test_trls_client_gets_the_teachers_logprobs(server, model, model_dir):
    client = _trl_client(server)
    assert client.model == str(model_dir)
    k = 5
    prompt_lengths = [3, 1, 6]
    got = client.get_sequence_logprobs(SEQUENCES, prompt_lengths, top_logprobs=k, temperature=1.0)
    for sequence, start, values, ids, actual, actual_ids in zip(SEQUENCES, prompt_lengths, got["logprobs"],
                                                                got["logprob_token_ids"], got["actual_logprobs"],
                                                                got["actual_token_ids"]):
        reference = _log_softmax(model, sequence)
        assert len(values) == len(sequence) - start
        for position, (row, row_ids, own, own_id) in enumerate(zip(values, ids, actual, actual_ids)):
            t = start + position  # the token at t, predicted at t - 1
            want = reference[t - 1]
            assert row_ids == want.topk(k).indices.tolist()
            assert row == pytest.approx(want.topk(k).values.tolist(), abs=1e-5)
            assert own_id == [sequence[t]]
            # vLLM lists each prompt token's own log-probability beside the top k: TRL reads it, in the top k or not
            assert own[0] == pytest.approx(want[sequence[t]].item(), abs=1e-5)
            assert math.isfinite(own[0])


def test_prompt_logprobs_match_vllms_json_and_ranks(server, model):
    response = _post(server, {"prompt": SEQUENCES, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0.5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 3
    assert body["usage"]["prompt_tokens"] == sum(map(len, SEQUENCES)) and body["usage"]["completion_tokens"] == 3
    for choice, sequence in zip(body["choices"], SEQUENCES):
        # vLLM computes prompt log-probabilities at temperature 1, whatever the request's temperature
        reference = _log_softmax(model, sequence)
        logprobs = choice["prompt_logprobs"]
        assert logprobs[0] is None and len(logprobs) == len(sequence)
        for t in range(1, len(sequence)):
            entries = {int(key): value for key, value in logprobs[t].items()}
            want = reference[t - 1]
            token = sequence[t]
            assert list(entries)[0] == token  # the prompt token first, as vLLM lists it
            assert entries[token]["rank"] == int((want >= want[token]).sum())
            assert entries[token]["logprob"] == pytest.approx(want[token].item(), abs=1e-5)
            top = want.topk(3)
            for rank, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert entries[other]["logprob"] == pytest.approx(value, abs=1e-5)
                assert entries[other]["rank"] == (rank if other != token else entries[token]["rank"])
            assert len(entries) == 3 + (token not in top.indices.tolist())
            assert all(isinstance(e["decoded_token"], str) for e in entries.values())


def test_the_servers_json_writer_writes_the_straightforward_writers_text(model_dir):
    from transformers import PreTrainedTokenizerFast

    from teacher_server.openai.protocol import TokenText, prompt_logprobs_json, write_prompt_logprobs

    generator = torch.Generator().manual_seed(0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    # Lengths across the writer's steps of positions; k 0 (ids scored only) to past a step's width.
    for length, k, scored_width, text in [(1, 3, 0, None), (2, 3, 0, tokenizer), (300, 5, 3, tokenizer),
                                          (40, 0, 4, None), (600, 20, 0, tokenizer)]:
        text = TokenText(text, VOCAB)
        logprobs = torch.randn(length, VOCAB, generator=generator).log_softmax(-1)
        logprobs[0, 7] = float("-inf")
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        if length > 4:
            ids[2], ids[1] = int(logprobs[1].argmax()), 7  # a prompt token in the top k; one at -inf
        top, top_ids = logprobs.topk(k, dim=1)
        following = torch.tensor(ids[1:] + ids[-1:])
        own = logprobs.gather(1, following[:, None])[:, 0]
        rank = (logprobs >= own[:, None]).sum(1)
        scored = scored_ids = None
        if scored_width:
            chosen = torch.randint(-1, VOCAB, (length, scored_width), generator=generator)
            chosen[:, 0] = following  # an id asked that is the prompt token, and one in the top k
            if k:
                chosen[:, 1] = top_ids[:, 0]
            scored = logprobs.gather(1, chosen.clamp_min(0)).masked_fill(chosen < 0, float("-inf"))
            scored_ids = chosen.tolist()
        want = prompt_logprobs_json(ids, top.tolist(), top_ids.tolist(), own.tolist(), rank.tolist(),
                                    None if scored is None else scored.tolist(), scored_ids, text)
        got = write_prompt_logprobs(ids, top.numpy(), top_ids.numpy(), own.numpy(), rank.numpy(),
                                    None if scored is None else scored.numpy(), scored_ids, text)
        assert got == want, (length, k, scored_width)
        assert len(json.loads(got)) == length


def test_a_request_cancelled_mid_answer_leaves_the_writer_no_answer_for_the_next_one():
    """The writer process answers in order down one pipe: a request cancelled while its answer is
    being written must not leave that answer for the next request to read as its own."""
    import asyncio

    import numpy as np

    from teacher_server.openai.protocol import TokenText, write_prompt_logprobs
    from teacher_server.openai.writer import JsonWriter

    text = TokenText(None, VOCAB)

    def arrays(seed: int, length: int, k: int):
        generator = torch.Generator().manual_seed(seed)
        logprobs = torch.randn(length, VOCAB, generator=generator).log_softmax(-1)
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        top, top_ids = logprobs.topk(k, dim=1)
        own = logprobs.gather(1, torch.tensor(ids[1:] + ids[-1:])[:, None])[:, 0]
        rank = (logprobs >= own[:, None]).sum(1)
        return ids, top.numpy(), top_ids.numpy(), own.numpy(), rank.numpy().astype(np.int64)

    long, short = arrays(1, 4000, 100), arrays(2, 50, 3)

    async def scenario() -> bytes:
        writer = JsonWriter(text)
        try:
            await writer.prompt_logprobs(*short)  # the child started
            first = asyncio.ensure_future(writer.prompt_logprobs(*long))
            await asyncio.sleep(0.2)  # its arrays sent, its answer (about 20 MB) being written
            assert not first.done()
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            return await writer.prompt_logprobs(*short)
        finally:
            await writer.close()

    assert asyncio.run(scenario()) == write_prompt_logprobs(*short[:5], None, None, text).encode()


def test_a_request_waits_for_the_writer_a_bounded_time_then_hears_it_is_busy():
    """The writer answers one request at a time: a request behind others gives up after the
    queue's timeout with an error that says what to do, and the writer serves the next one."""
    import asyncio

    import numpy as np

    from teacher_server.openai.protocol import TokenText, write_prompt_logprobs
    from teacher_server.openai.writer import JsonWriter, WriterBusy

    text = TokenText(None, VOCAB)
    ids = [1, 2, 3]
    arrays = (ids, np.zeros((3, 2), np.float32), np.zeros((3, 2), np.int64), np.zeros(3, np.float32),
              np.ones(3, np.int64))

    async def scenario() -> bytes:
        writer = JsonWriter(text, queue_timeout_s=0.3)
        try:
            turn = await writer.turns.acquire("other", 1)  # another request's turn, for longer than the queue waits
            started = asyncio.get_running_loop().time()
            with pytest.raises(WriterBusy, match="retry later"):
                await writer.prompt_logprobs(*arrays, job="this")
            assert 0.25 < asyncio.get_running_loop().time() - started < 5
            turn.release()
            return await writer.prompt_logprobs(*arrays, job="this")
        finally:
            await writer.close()

    assert asyncio.run(scenario()) == write_prompt_logprobs(*arrays, None, None, text).encode()


def test_extensions_prompt_temperature_and_ids_scored_at_every_position(server, model):
    sequence = SEQUENCES[0]
    scored = [[1, 2, -1], [3, 4, 5], [6, -1, -1]]  # rows for positions 2, 3, 4 (predicting tokens 3, 4, 5)
    response = _post(server, {"prompt": sequence, "max_tokens": 1, "prompt_logprobs": 2,
                              "prompt_logprobs_temperature": 2.0, "prompt_logprob_token_ids": scored,
                              "prompt_logprob_start": 2})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["prompt_logprobs"]
    reference = _log_softmax(model, sequence, temperature=2.0)
    for row, ids in enumerate(scored):
        position = 2 + row
        entries = {int(key): value for key, value in logprobs[position + 1].items()}
        for token in (i for i in ids if i >= 0):
            assert entries[token]["logprob"] == pytest.approx(reference[position, token].item(), abs=1e-5)
    assert {int(key) for key in logprobs[1]} == {sequence[1], *reference[0].topk(2).indices.tolist()}
    # Two prompts, ids of different widths per prompt (the longer one in chunks).
    per_prompt = [[[7, 12], [8, 13]], [[9, 10, 11]] * 4]
    response = _post(server, {"prompt": SEQUENCES[1:], "max_tokens": 1, "prompt_logprobs": 0,
                              "prompt_logprob_token_ids": per_prompt, "prompt_logprob_start": 1})
    assert response.status_code == 200, response.text
    for choice, prompt, rows in zip(response.json()["choices"], SEQUENCES[1:], per_prompt):
        reference = _log_softmax(model, prompt)
        for row, ids in enumerate(rows):
            entries = {int(key): value for key, value in choice["prompt_logprobs"][row + 2].items()}
            assert set(entries) == {prompt[row + 2], *ids}
            for token in ids:
                assert entries[token]["logprob"] == pytest.approx(reference[row + 1, token].item(), abs=1e-5)


def _forwards(server) -> float:
    text = requests.get(f"{_http(server)}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("teacher_forward_seconds_count"))


def test_a_prompt_longer_than_a_forward_runs_in_chunks_on_the_kv_cache(server, model):
    sequence = [(11 * i + 3) % VOCAB for i in range(5 * CHUNK_TOKENS - 3)]  # 5 chunks, the last one short
    start = CHUNK_TOKENS - 2  # scored rows that cross the chunks' edges
    scored = [[(5 * row) % VOCAB, -1, row] for row in range(2 * CHUNK_TOKENS)]
    before = _forwards(server)
    response = _post(server, {"prompt": sequence, "max_tokens": 2, "temperature": 0, "logprobs": 3,
                              "prompt_logprobs": 4, "prompt_logprob_token_ids": scored, "prompt_logprob_start": start,
                              "return_token_ids": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    reference = _log_softmax(model, sequence)
    logprobs = choice["prompt_logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(sequence)
    for t in range(1, len(sequence)):
        entries = {int(key): value for key, value in logprobs[t].items()}
        want, token = reference[t - 1], sequence[t]
        assert list(entries)[0] == token and entries[token]["rank"] == int((want >= want[token]).sum())
        top = want.topk(4)
        for value, other in zip(top.values.tolist(), top.indices.tolist()):
            assert entries[other]["logprob"] == pytest.approx(value, abs=1e-5)
        asked = scored[t - 1 - start] if 0 <= t - 1 - start < len(scored) else []
        for other in (i for i in asked if i >= 0):
            assert entries[other]["logprob"] == pytest.approx(want[other].item(), abs=1e-5)
    # Greedy tokens from the last chunk's distribution; the second from the sequence one longer, chunked again.
    generated = list(sequence)
    for _ in range(2):
        generated.append(int(_log_softmax(model, generated)[-1].argmax()))
    assert choice["token_ids"] == generated[len(sequence):]
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(reference[-1].max().item(), abs=1e-5)
    # One forward per chunk: 5 for the prompt, 5 for it with the first generated token.
    wait_until(lambda: _forwards(server) - before == 10, 30, "the chunks' forwards to be counted")


def test_more_long_prompts_than_a_job_runs_at_once_each_get_their_own_values(server, model):
    """Five prompts of three chunks each in one request: a job runs two prompts on the KV cache at
    once (routes.LIVE_PREFIXES_PER_JOB), the others wait their turn; each prompt's values are its own."""
    prompts = [[(13 * i + 5 * p + 1) % VOCAB for i in range(3 * CHUNK_TOKENS - p)] for p in range(5)]
    response = _post(server, {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    for choice, prompt in zip(response.json()["choices"], prompts):
        reference = _log_softmax(model, prompt)
        logprobs = choice["prompt_logprobs"]
        assert len(logprobs) == len(prompt)
        for t in range(1, len(prompt)):
            entries = {int(key): value for key, value in logprobs[t].items()}
            assert entries[prompt[t]]["logprob"] == pytest.approx(reference[t - 1, prompt[t]].item(), abs=1e-5)


def _writers(server) -> list[int]:
    """The teacher's JSON writer processes (teacher_server/openai/writer.py)."""
    from pathlib import Path

    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"teacher_server.openai.writer" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_the_json_is_written_by_a_lower_priority_process_started_again_if_it_dies(server, model):
    import os
    import signal

    body = {"prompt": SEQUENCES[1], "max_tokens": 1, "prompt_logprobs": 2}
    assert _post(server, body).status_code == 200
    [writer] = _writers(server)
    assert os.getpriority(os.PRIO_PROCESS, writer) == os.getpriority(os.PRIO_PROCESS, server.proc.pid) + 10
    os.kill(writer, signal.SIGKILL)
    response = _post(server, body)  # written by the next one
    assert response.status_code == 200, response.text
    reference = _log_softmax(model, SEQUENCES[1])
    entries = response.json()["choices"][0]["prompt_logprobs"][1]
    assert entries[str(SEQUENCES[1][1])]["logprob"] == pytest.approx(reference[0, SEQUENCES[1][1]].item(), abs=1e-5)
    assert len(_writers(server)) == 1 and _writers(server) != [writer]


def test_generation_greedy_and_seeded_with_echo_and_logprobs(server, model):
    prompt = SEQUENCES[1]
    greedy = _post(server, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                            "return_token_ids": True}).json()["choices"][0]
    sequence = list(prompt)
    for _ in range(3):
        sequence.append(int(_log_softmax(model, sequence)[-1].argmax()))
    assert greedy["token_ids"] == sequence[len(prompt):] and greedy["finish_reason"] == "length"
    last = _log_softmax(model, sequence[:-1])[-1]
    assert greedy["logprobs"]["token_logprobs"][-1] == pytest.approx(last[sequence[-1]].item(), abs=1e-5)
    assert len(greedy["logprobs"]["top_logprobs"][-1]) <= 3
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    first, second = (_post(server, body).json()["choices"][0]["token_ids"] for _ in range(2))
    assert first == second and len(first) == 4
    echoed = _post(server, {"prompt": "def add(a, b):", "max_tokens": 1, "echo": True, "logprobs": 1}).json()
    choice = echoed["choices"][0]
    assert choice["text"].startswith("def add(a, b):")
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["prompt_logprobs"]) > 1


@pytest.mark.parametrize("body, code, param, says", [
    ({"prompt": [1, 2], "prompt_logprobs": 301}, 400, "prompt_logprobs", "greater than max allowed: 300"),
    ({"prompt": [1, 2], "stream": True}, 400, "stream", "does not support streaming"),
    ({"prompt": [1, 2], "n": 2}, 400, "n", "does not support n > 1"),
    ({"prompt": [1, VOCAB]}, 400, "prompt", "outside the teacher's vocabulary"),
    ({"prompt": []}, 400, "prompt", "must be a string"),
    ({"prompt": [1, 2], "model": "other"}, 404, "model", "The model `other` does not exist."),
    ({"prompt": [1, 2], "max_tokens": 1000}, 400, "max_tokens", "more than this teacher generates"),
    ({"prompt": [1] * 9000, "max_tokens": 1}, 400, "prompt", "maximum context length"),
    # What an outside check sent that once got a bare 500 (or a wrong answer):
    ({"prompt": [1, 2], "n": True}, 400, "n", "does not support n > 1"),
    ({"prompt": [1, 2], "seed": 2 ** 70}, 400, "seed", "must fit in 64 bits"),
    ({"prompt": [1, 2], "prompt_logprobs": 1, "prompt_logprobs_temperature": 1e-300}, 400,
     "prompt_logprobs_temperature", "use at least 0.001"),
    ({"prompt": [1, 2], "prompt_logprob_token_ids": {"0": [1]}}, 400, "prompt_logprob_token_ids", "must be a list"),
    ({"prompt": [1, 2], "prompt_logprob_token_ids": 7}, 400, "prompt_logprob_token_ids", "must be a list"),
    ("nested", 400, None, "the request body is not JSON"),
])
def test_bad_requests_get_vllms_error_shape_and_say_what_to_change(server, body, code, param, says):
    if body == "nested":  # a prompt nested past Python's recursion limit
        response = requests.post(f"{_http(server)}/v1/completions", data=b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000
                                 + b"}", timeout=60, headers={"Authorization": f"Bearer {JOB_TOKEN}"})
    else:
        response = _post(server, body)
    assert response.status_code == code, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param and says in error["message"]


def test_requests_need_a_token_and_run_as_the_tokens_job(server):
    assert requests.get(f"{_http(server)}/health", timeout=10).status_code == 200
    assert requests.get(f"{_http(server)}/v1/models", timeout=10).status_code == 401
    refused = _post(server, {"prompt": [1, 2]}, token="")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
    assert _post(server, {"prompt": [1, 2, 3], "prompt_logprobs": 1}).status_code == 200
    jobs = {s["job_id"]: s for s in _status(server)}
    assert jobs["trl-job"]["backend"] == "local" and jobs["trl-job"]["tokens_served"] > 0
    assert _post(server, {"prompt": [1, 2, 3], "prompt_logprobs": 1}, token=OPERATOR).status_code == 200
    assert "openai-api" in {s["job_id"] for s in _status(server)}


def _gauges(server) -> dict[str, float]:
    text = requests.get(f"{_http(server)}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30).text
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("teacher_api_")}


def _raw_post(server, body: dict, after: bytes = b"") -> socket.socket:
    """A connection that has sent a completions request (then `after`) and read nothing of its answer."""
    payload = json.dumps(body).encode()
    peer = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    peer.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer " + JOB_TOKEN.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(payload)
                 + payload + after)
    return peer


def test_an_answer_too_large_for_the_teachers_memory_is_refused_and_the_bytes_come_back(server, model_dir):
    """Each request is charged an upper bound of its answer before its first forward: one that
    alone needs more than --api-max-answer-bytes is refused saying what to change; a served one's
    body is within its charge; and the bytes come back once answers are sent, also to a peer
    that left without reading its answer."""
    from transformers import AutoTokenizer

    from teacher_server.openai.budget import JSON_COPIES, answer_bytes, entry_bytes
    from teacher_server.openai.protocol import TokenText, parse_completion

    long_prompts = [[(7 * i + j) % VOCAB for i in range(200)] for j in range(30)]
    refused = _post(server, {"prompt": long_prompts, "max_tokens": 1, "prompt_logprobs": 300})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "--api-max-answer-bytes" in error["message"]
    assert "64.0 MiB" in error["message"]
    # A large answer that fits: its body (one copy) within the charge, computed here from the same bound.
    body = {"prompt": SEQUENCES, "max_tokens": 3, "prompt_logprobs": 300, "echo": True, "logprobs": 5}
    served = _post(server, body)
    assert served.status_code == 200, served.text
    text = TokenText(AutoTokenizer.from_pretrained(model_dir), VOCAB)
    charged = answer_bytes(parse_completion(body, vocab_size=VOCAB, max_logprobs=300, max_prompts=16384),
                           vocab_size=VOCAB, entry_size=entry_bytes(text))
    assert JSON_COPIES * len(served.content) <= charged
    # A peer that reads the start of its answer (~20 MB) and then nothing: the answer's bytes stay
    # charged while it waits to be taken, and come back when the peer leaves.
    in_transit = {"prompt": long_prompts[:5], "max_tokens": 1, "prompt_logprobs": 300}
    charged = answer_bytes(parse_completion(in_transit, vocab_size=VOCAB, max_logprobs=300, max_prompts=16384),
                           vocab_size=VOCAB, entry_size=entry_bytes(text))
    assert charged <= ANSWER_LIMIT
    with _raw_post(server, in_transit) as peer:
        status = b""
        while len(status) < 12:
            status += peer.recv(12 - len(status))
        assert status == b"HTTP/1.1 200"  # the answer is being sent
        time.sleep(1)
        assert _gauges(server)["teacher_api_answer_bytes"] == charged  # and not taken
        # Requests that do not fit beside it wait; their clients leave (after a stray CRLF, which the
        # teacher must read past to see them go): they wait no more, and the log says so in one
        # line, not one a request (at most one such line per 10 s).
        start = len(server.log_lines)
        peers = [_raw_post(server, {"prompt": long_prompts[:2], "max_tokens": 1, "prompt_logprobs": 300}, b"\r\n")
                 for _ in range(12)]
        wait_until(lambda: _gauges(server)["teacher_api_requests_waiting"] == 12, 30, "the others waiting")
        for waiting in peers:
            waiting.close()
        wait_until(lambda: _gauges(server)["teacher_api_requests_waiting"] == 0, 30, "the waits dropped")
        time.sleep(0.5)
        left = "a client left before its completion"
        left_lines = [line for line in server.log_lines[start:] if left in line]
        # One line, or none where one came less than 10 s before (the server logs no other cause of it).
        assert len(left_lines) == 1 or not left_lines and any(left in line for line in server.log_lines[:start]), \
            left_lines
        assert _gauges(server)["teacher_api_answer_bytes"] == charged
    wait_until(lambda: _gauges(server)["teacher_api_answer_bytes"] == 0, 30, "the charge given back")
    time.sleep(0.5)
    assert _gauges(server)["teacher_api_answer_bytes"] == 0  # the dropped request was never served
    gauges = _gauges(server)
    assert gauges["teacher_api_answer_limit_bytes"] == ANSWER_LIMIT and gauges["teacher_api_requests_waiting"] == 0
    assert _post(server, {"prompt": [1, 2, 3], "prompt_logprobs": 1}).status_code == 200


def _status(server) -> list[dict]:
    response = requests.get(f"{_http(server)}/v1/status", headers={"Authorization": f"Bearer {OPERATOR}"},
                            timeout=10)
    return response.json()["sessions"]


__all__ = ["status_sessions"]


@pytest.mark.slow
def test_trls_server_distillation_trainer_trains_from_the_teacher(model_dir, tmp_path, monkeypatch):
    """TRL's ServerDistillationTrainer with teacher_model_server_url at the teacher: a few steps
    of a tiny student (TRL's client requires vLLM to be importable for weight sync, which a
    frozen teacher does not use: that check alone is bypassed), the teacher serving every request."""
    import trl.generation.vllm_client as vllm_client
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    from distill_demo.tokenizer import train_tokenizer

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    student_dir = build_tiny_model(tmp_path / "student", vocab_size=VOCAB, layers=1, seed=1)
    train_tokenizer(TEXTS, vocab_size=300, save_dir=student_dir)
    server = ServerProcess("--model", str(model_dir))  # no token: TRL's client sends none
    try:
        data = Dataset.from_dict({"prompt": ["def add(a, b):", "The quick brown", "for i in", "class Point:"] * 2})
        args = ServerDistillationConfig(
            output_dir=str(tmp_path / "out"), teacher_model_server_url=_http(server), max_steps=3,
            per_device_train_batch_size=2, max_completion_length=8, loss_top_k=5, beta=0.0, report_to=[],
            use_cpu=True, logging_steps=1, learning_rate=1e-3, save_strategy="no")
        trainer = ServerDistillationTrainer(model=str(student_dir), args=args, train_dataset=data,
                                            processing_class=AutoTokenizer.from_pretrained(student_dir))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        assert len(losses) == 3 and all(math.isfinite(loss) and loss > 0 for loss in losses)
        served = {s["job_id"]: s for s in requests.get(f"{_http(server)}/v1/status", timeout=10).json()["sessions"]}
        assert served["openai-api"]["batches_sent"] >= 3 and served["openai-api"]["tokens_served"] > 0
    finally:
        server.stop()


def test_sampling_many_prompts_leaves_the_teacher_answering_everyone_else(tmp_path):
    """One request of 1,500 one-token prompts sampled at temperature 1 over a 128,256-token vocabulary
    (builtin:wide): each prompt's softmax and draw run in a thread, off the loop that every tenant's
    gRPC and HTTP calls share, so /healthz answers within a second throughout. On the loop they
    held it about 2.3 ms a prompt here (an outside check: 18 s for 8,000 prompts, sessions of
    other tenants expired)."""
    import threading

    tokens = tmp_path / "jobs.json"
    tokens.write_text(json.dumps({"trl-job": {"token": JOB_TOKEN}}))
    server = ServerProcess("--model", "builtin:wide", "--auth-token", OPERATOR, "--job-tokens", str(tokens))
    try:
        body = {"prompt": [[i % 512] for i in range(1500)], "max_tokens": 1, "temperature": 1.0, "seed": 1}
        answered: dict = {}

        def request() -> None:
            answered["response"] = _post(server, body)

        sampling = threading.Thread(target=request)
        sampling.start()
        waits = []
        while sampling.is_alive():
            started = time.monotonic()
            assert requests.get(f"{_http(server)}/healthz", timeout=30).status_code == 200
            waits.append(time.monotonic() - started)
            time.sleep(0.05)
        sampling.join()
        response = answered["response"]
        assert response.status_code == 200 and len(response.json()["choices"]) == 1500, response.text[:300]
        assert len(waits) > 10 and max(waits) < 1.0, f"/healthz waited up to {max(waits):.2f} s ({len(waits)} probes)"
    finally:
        server.stop()
