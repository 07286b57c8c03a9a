"""The routes: `GET /v1/models`, `GET /health`, `POST /v1/completions` (vLLM's shapes, protocol.py)."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid

import numpy as np
import torch
from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from distill_common.outputs import OutputRequest, TeacherFacts
from teacher_server.edge import Callers, RateLimitedLog
from teacher_server.errors import ServiceError
from teacher_server.model_runner import Chunk, Prefix
from teacher_server.openai.budget import AnswerBudget, AnswerBudgetBusy, AnswerTooLarge, answer_bytes, entry_bytes
from teacher_server.openai.jobs import ApiJobs, BatchFailed
from teacher_server.openai.outputs import NEXT_IDS, SCORE_IDS, CompletionLogprobs
from teacher_server.openai.protocol import ApiError, CompletionParams, TokenText, parse_completion
from teacher_server.openai.writer import JsonWriter, WriterBusy, WriterFailed

log = logging.getLogger(__name__)
# A client that leaves early is a line per 10 s at most, with a count: a token holder's loop of
# requests it drops at once was otherwise a line each.
_clients_left_log = RateLimitedLog(logger=log, level=logging.INFO)

# The most bytes of whole distributions (one per row, to sample the next token from) a batch holds:
# 1-token prompts would otherwise make a batch of --max-batch-tokens rows of the vocabulary each.
LAST_ROWS_BYTES = 256 << 20
# The job of requests made with the operator's token (or none): job tokens make their own jobs.
OPERATOR_JOB = "openai-api"
_STATUS_CODES = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
                 "FAILED_PRECONDITION": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}


# How long a request waits for its turn at the answer memory (budget.py) and at the JSON writer.
QUEUE_TIMEOUT_S = 300.0
# Prompts of one job run a chunk at a time on the model's KV cache at once, at most (each prompt's
# cache lives until its last chunk): the KV memory a job's requests hold is this many prompts of
# up to --max-seq-len, however many long prompts it sends. Two keep the device busy between one
# prompt's chunk returning and its next being submitted.
LIVE_PREFIXES_PER_JOB = 2
# A prompt's chunks queued at once: the next waits in the queue while the one before runs, so that
# fair share weighs this job against the others' batches between two of its chunks (one at a time,
# a job that never pauses ran a whole batch between any two, and the chunked request took a forward
# of it per chunk: 22x its time alone at 1,024 tokens, bench/openai_logprobs.py). Its slot keeps a
# session's --max-inflight for the two (a chunk runs only right after the one before it: Prefix).
CHUNKS_QUEUED = 2


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.code)


async def _off_the_loop(function, *args):
    """`function(*args)` in a thread: work that grows with a request's prompts and the vocabulary
    (sampling, copies, the JSON) must not hold the loop that every tenant's gRPC and HTTP calls
    share (8,000 prompts sampled on it once stopped the teacher for 18 s). Cancelled, it still
    waits for the thread: the thread holds the request's tensors until it ends, and so does its
    charge against the job."""
    running = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait({running})
        raise


class Completions:
    """One teacher's completions: prompts in, batches through the engine, vLLM's JSON out.

    A request's forwards are bounded by `chunk_tokens` (--api-chunk-tokens): its prompts are
    grouped into batches of at most that many padded tokens, and a longer prompt runs a chunk
    at a time on the model's KV cache (`model_runner.Prefix`; on one process: under tensor
    parallelism such a prompt runs whole, as one batch). Each batch is a forward of its own,
    and the scheduler's fair share puts other jobs' batches between them, so another job's
    batch waits for one chunk at most, not for a whole request.
    """

    def __init__(self, jobs: ApiJobs, facts: TeacherFacts, tokenizer, *, model_id: str, max_seq_len: int,
                 max_batch_tokens: int, max_logprobs: int, answer_limit_bytes: int, chunk_tokens: int = 0,
                 chunked_prompts: bool = True, queue_timeout_s: float = QUEUE_TIMEOUT_S):
        self.jobs = jobs
        self.facts = facts
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_seq_len = max_seq_len
        self.max_batch_tokens = max_batch_tokens
        self.max_logprobs = max_logprobs
        # Padded tokens of one forward of a request (0: --max-batch-tokens); longer prompts in
        # chunks of as many when `chunked_prompts` (one process), whole otherwise.
        self.batch_tokens = min(chunk_tokens, max_batch_tokens) if chunk_tokens else max_batch_tokens
        self.chunked_prompts = chunked_prompts and self.batch_tokens < max_batch_tokens
        self.max_prompt_tokens = max_seq_len if self.chunked_prompts else min(max_seq_len, max_batch_tokens)
        self.text = TokenText(tokenizer, facts.vocab_size)
        self.writer = JsonWriter(self.text, queue_timeout_s=queue_timeout_s)  # prompt_logprobs, in a process of its own
        self.budget = AnswerBudget(answer_limit_bytes, timeout_s=queue_timeout_s)  # what answers hold, all requests
        self._entry_bytes = 0  # the longest prompt_logprobs entry of the vocabulary (found at the first request)
        self.eos = getattr(tokenizer, "eos_token_id", None)
        self._prefix_slots: dict[str, asyncio.Semaphore] = {}  # by job: LIVE_PREFIXES_PER_JOB each

    def parse(self, body) -> CompletionParams:
        params = parse_completion(body, vocab_size=self.facts.vocab_size, max_logprobs=self.max_logprobs,
                                  max_prompts=max(1, self.max_batch_tokens))
        if params.model not in (None, self.model_id):
            raise ApiError(f"The model `{params.model}` does not exist.", param="model", code=404,
                           kind="NotFoundError")
        for index, prompt in enumerate(params.prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ApiError("this teacher has no tokenizer (its --model is no directory with one): send "
                                   "prompts as token ids", param="prompt")
                params.prompts[index] = list(self.tokenizer(prompt, add_special_tokens=params.add_special_tokens)[
                    "input_ids"])
            length = len(params.prompts[index])
            if length + params.max_tokens > self.max_prompt_tokens:
                raise ApiError(f"This model's maximum context length is {self.max_prompt_tokens} tokens (the teacher's "
                               f"--max-seq-len{'' if self.chunked_prompts else ' and --max-batch-tokens'}). However, "
                               f"you requested "
                               f"{length + params.max_tokens} tokens ({length} in the prompt {index}, "
                               f"{params.max_tokens} in the completion). Please reduce the length of the prompt or "
                               "completion.", param="prompt")
        if params.prompt_logprob_token_ids is not None:
            for index, (prompt, rows) in enumerate(zip(params.prompts, params.prompt_logprob_token_ids)):
                if params.prompt_logprob_start + len(rows) > len(prompt) - 1:
                    raise ApiError(f"prompt_logprob_token_ids[{index}] has {len(rows)} rows from "
                                   f"prompt_logprob_start {params.prompt_logprob_start}, but prompt {index} has "
                                   f"{len(prompt) - 1} scored rows (its length - 1)", param="prompt_logprob_token_ids")
        if not self._entry_bytes:
            self._entry_bytes = entry_bytes(self.text)
        params.answer_bytes = answer_bytes(params, vocab_size=self.facts.vocab_size, entry_size=self._entry_bytes,
                                           padded_positions=self._padded_positions(params))
        return params

    def _padded_positions(self, params: CompletionParams) -> int:
        """The positions of the batches `_run` makes of the request's prompts, padding included
        (a prompt run in chunks has none)."""
        lengths = [len(p) for p in params.prompts]
        padded = 0
        for batch in self._batches(lengths, params.max_tokens > 0):
            if self._in_chunks(batch, lengths):
                padded += lengths[batch[0]]
            else:
                padded += len(batch) * lengths[batch[0]]
        return padded

    def _in_chunks(self, batch: list[int], lengths: list[int]) -> bool:
        """Whether `_run` runs this batch (of prompt indices) a chunk at a time on the KV cache."""
        return len(batch) == 1 and self.chunked_prompts and lengths[batch[0]] > self.batch_tokens

    def _batches(self, lengths: list[int], last: bool) -> list[list[int]]:
        """Prompt indices grouped into batches of at most `batch_tokens` padded tokens, longest
        first (a longer prompt alone); with `last` (a row's whole distribution at its end, 4
        bytes an entry of the vocabulary), at most LAST_ROWS_BYTES of those a batch."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        max_rows = max(1, LAST_ROWS_BYTES // (4 * self.facts.vocab_size)) if last else len(lengths)
        batches, current = [], []
        for index in order:
            width = lengths[current[0]] if current else lengths[index]  # longest first: the batch's first
            if current and (width * (len(current) + 1) > self.batch_tokens or len(current) == max_rows):
                batches.append(current)
                current = []
            current.append(index)
        return batches + ([current] if current else [])

    async def _run(self, job: tuple, sequences: list[list[int]], kind: CompletionLogprobs,
                   score_rows: list | None = None, start: int = 0) -> list[list[torch.Tensor]]:
        """Each sequence's tensors of `kind` (per sequence: the kind's tensors, its own rows)."""
        request = OutputRequest((kind,), torch.float32, self.facts)
        results: list = [None] * len(sequences)

        async def chunked(i: int) -> None:
            """Sequence i, longer than `batch_tokens`, a chunk at a time on the model's KV cache."""
            sequence, prefix, parts = sequences[i], Prefix(), []
            rows = None
            if kind.scored:
                rows = torch.full((1, len(sequence), kind.scored), -1, dtype=torch.int64)
                given = torch.tensor(score_rows[i], dtype=torch.int64)
                rows[0, start:start + len(given), :given.shape[1]] = given
            slots = self._prefix_slots.setdefault(job[0], asyncio.Semaphore(LIVE_PREFIXES_PER_JOB))
            queued: collections.deque = collections.deque()  # chunks queued, in order, not yet taken

            async def take() -> None:
                tensors = await self.jobs.served(queued.popleft())
                # `last` (a whole distribution) is the final chunk's alone: the others' go at once.
                final = len(parts) + 1 == chunks
                parts.append([t[0] for t in (tensors if final or not kind.last else tensors[:-1])])

            chunks = -(-len(sequence) // self.batch_tokens)
            async with slots:  # its KV cache lives from its first chunk to its last
                for begin in range(0, len(sequence), self.batch_tokens):
                    end = min(len(sequence), begin + self.batch_tokens)
                    ids = torch.tensor([sequence[begin:end]], dtype=torch.int64)
                    following = sequence[begin + 1:end + 1]
                    data = {NEXT_IDS: torch.tensor([following + [0] * (end - begin - len(following))],
                                                   dtype=torch.int64)}
                    if rows is not None:
                        data[SCORE_IDS] = rows[:, begin:end]
                    # The next chunk waits in the queue while this one runs (CHUNKS_QUEUED), so that the
                    # job's share is weighed against the others' batches between two of its chunks.
                    queued.append(await self.jobs.enqueue(job[0], request, ids, torch.ones_like(ids), data,
                                                          max_job_sessions=job[1], job_limit=job[2],
                                                          chunk=Chunk(prefix, begin),
                                                          after=queued[-1] if queued else None))
                    if len(queued) == CHUNKS_QUEUED:
                        await take()
                while queued:
                    await take()
            by_position = len(parts[-1]) - (1 if kind.last else 0)
            results[i] = ([torch.cat([part[j] for part in parts]) for j in range(by_position)]
                          + ([parts[-1][-1]] if kind.last else []))

        async def one(indices: list[int]) -> None:
            if self._in_chunks(indices, lengths):
                return await chunked(indices[0])
            width = max(len(sequences[i]) for i in indices)
            ids = torch.zeros(len(indices), width, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            data = {}
            if kind.scored:
                data[SCORE_IDS] = torch.full((len(indices), width, kind.scored), -1, dtype=torch.int64)
            for row, i in enumerate(indices):
                ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, :len(sequences[i])] = 1
                if kind.scored:
                    rows = torch.tensor(score_rows[i], dtype=torch.int64)
                    data[SCORE_IDS][row, start:start + len(rows), :rows.shape[1]] = rows
            tensors = await self.jobs.submit(job[0], request, ids, mask, data, max_job_sessions=job[1],
                                             job_limit=job[2])
            # Each prompt's own positions, copied: a view would keep the whole padded batch alive.
            by_position = len(tensors) - (1 if kind.last else 0)

            def copy_rows() -> None:
                for row, i in enumerate(indices):
                    length = len(sequences[i])
                    results[i] = ([t[row, :length].clone() for t in tensors[:by_position]]
                                  + ([tensors[-1][row].clone()] if kind.last else []))

            await _off_the_loop(copy_rows)

        lengths = [len(s) for s in sequences]
        await asyncio.gather(*(one(indices) for indices in self._batches(lengths, kind.last)))
        return results

    async def close(self) -> None:
        await self.writer.close()

    async def complete(self, params: CompletionParams, job: tuple) -> bytes:
        prompts = params.prompts
        want_prompt = params.prompt_logprobs is not None
        scored = params.prompt_logprob_token_ids
        first = CompletionLogprobs(prompt_k=params.prompt_logprobs if want_prompt else -1,
                                   scored=max((len(rows[0]) for rows in scored), default=0) if scored else 0,
                                   last=params.max_tokens > 0, temperature=params.prompt_logprobs_temperature)
        results = await self._run(job, prompts, first, scored, params.prompt_logprob_start)
        generated: list[list[int]] = [[] for _ in prompts]
        gen_logprobs: list[list[tuple[float, list[tuple[int, float]]]]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        lasts = [r.pop() for r in results] if params.max_tokens else []  # held once: here, not in results too
        generators = [None if params.seed is None else torch.Generator().manual_seed(params.seed)
                      for _ in prompts]
        following = CompletionLogprobs(prompt_k=-1, last=True)
        for step in range(params.max_tokens):
            live = [i for i in range(len(prompts)) if finish[i] == "length" and len(generated[i]) == step]
            await _off_the_loop(self._sample, params, live, lasts, generators, generated, gen_logprobs, finish)
            going = [i for i in live if finish[i] == "length"]
            if step + 1 < params.max_tokens and going:
                more = await self._run(job, [prompts[i] + generated[i] for i in going], following)
                for i, tensors in zip(going, more):
                    lasts[i] = tensors[-1]
        prompt_json = [b"null"] * len(prompts)
        if params.prompt_logprobs is not None:  # most of the response: written by the writer process
            for index, (prompt, tensors) in enumerate(zip(prompts, results)):
                top, top_ids, own, rank = (t.numpy() for t in tensors[:4])
                scored_values = scored_ids = None
                if scored:  # by position: the request's row i is position start + i; -1 pads
                    scored_values = tensors[4].numpy()
                    rows = np.asarray(scored[index], dtype=np.int64)
                    scored_ids = np.full(scored_values.shape, -1, dtype=np.int64)
                    start = params.prompt_logprob_start
                    scored_ids[start:start + rows.shape[0], :rows.shape[1]] = rows
                prompt_json[index] = await self.writer.prompt_logprobs(prompt, top, top_ids, own, rank, scored_values,
                                                                       scored_ids, job=job[0])
        return await _off_the_loop(self._response, params, results, generated, gen_logprobs, finish, prompt_json)

    def _sample(self, params: CompletionParams, live: list[int], lasts, generators, generated, gen_logprobs,
                finish) -> None:
        """One generated token for each prompt of `live` (its index), from its last position's
        log-probabilities `lasts[i]`; its log-probabilities when asked, "stop" at the end of text.
        A softmax over the vocabulary a prompt: in a thread (`_off_the_loop`), never on the loop."""
        for i in live:
            logprobs = lasts[i]
            if params.temperature < 1e-5:
                token = int(logprobs.argmax())
            else:
                probs = torch.softmax(logprobs.double() / params.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generators[i]))
            generated[i].append(token)
            if params.logprobs is not None:
                top = logprobs.topk(min(params.logprobs, logprobs.numel())) if params.logprobs else None
                others = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
                gen_logprobs[i].append((float(logprobs[token]), others))
            if token == self.eos and not params.ignore_eos:
                finish[i] = "stop"

    def _response(self, params: CompletionParams, results, generated, gen_logprobs, finish,
                  prompt_json: list[bytes]) -> bytes:
        """The response's JSON, each prompt's `prompt_logprobs` (`prompt_json`) put in by joining bytes."""
        as_id = params.return_tokens_as_token_ids
        parts = []
        prompt_tokens = completion_tokens = 0
        for index, (prompt, tensors) in enumerate(zip(params.prompts, results)):
            prompt_tokens += len(prompt)
            completion_tokens += len(generated[index])
            text = self.text.text(generated[index])
            logprobs_json = "null"
            if params.logprobs is not None:
                logprobs_json = self._completion_logprobs(params, prompt, tensors, generated[index],
                                                          gen_logprobs[index], as_id)
            if params.echo:
                text = self.text.text(prompt) + text
            before = (f'{{"index":{index},"text":{json.dumps(text)},"logprobs":{logprobs_json},'
                      f'"finish_reason":{json.dumps(finish[index] if params.max_tokens else "length")},'
                      f'"stop_reason":null,"prompt_logprobs":')
            after = "}"
            if params.return_token_ids:
                after = f',"prompt_token_ids":{json.dumps(prompt)},"token_ids":{json.dumps(generated[index])}}}'
            parts += [b"," if index else b"", before.encode(), prompt_json[index], after.encode()]
        usage = (f'{{"prompt_tokens":{prompt_tokens},"total_tokens":{prompt_tokens + completion_tokens},'
                 f'"completion_tokens":{completion_tokens},"prompt_tokens_details":null}}')
        head = (f'{{"id":"cmpl-{uuid.uuid4().hex}","object":"text_completion","created":{int(time.time())},'
                f'"model":{json.dumps(self.model_id)},"choices":[')
        return b"".join([head.encode(), *parts, f'],"usage":{usage},"system_fingerprint":null}}'.encode()])

    def _completion_logprobs(self, params, prompt, tensors, generated, gen_logprobs, as_id) -> str:
        """OpenAI's legacy `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset; the
        prompt's first (null for its first token) when echoing."""
        tokens, values, tops = [], [], []
        if params.echo:
            top, top_ids, own, _ = (t.tolist() for t in tensors[:4])
            tokens.append(self.text.token(prompt[0], as_id))
            values.append(None)
            tops.append(None)
            for t in range(1, len(prompt)):
                tokens.append(self.text.token(prompt[t], as_id))
                values.append(max(own[t - 1], -9999.0))
                entry = {self.text.token(prompt[t], as_id): max(own[t - 1], -9999.0)}
                for value, other in list(zip(top[t - 1], top_ids[t - 1]))[:params.logprobs]:
                    entry.setdefault(self.text.token(other, as_id), max(value, -9999.0))
                tops.append(entry)
        for token, (value, others) in zip(generated, gen_logprobs):
            tokens.append(self.text.token(token, as_id))
            values.append(max(value, -9999.0))
            entry = {self.text.token(token, as_id): max(value, -9999.0)}
            for other, other_value in others:
                entry.setdefault(self.text.token(other, as_id), max(other_value, -9999.0))
            tops.append(entry)
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return json.dumps({"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops})


# A completion's JSON is sent in pieces of this size: uvicorn writes each piece whole into the
# transport and waits for the peer to take it (edge.GuardedH11Protocol's small buffers) only
# before the next one, so an answer sent whole would leave its bytes in the transport, no longer
# charged, for as long as a slow peer takes to read them.
ANSWER_PIECE_BYTES = 256 << 10


class _AnswerResponse(Response):
    """A completion's JSON, sent a piece at a time; its answer memory (`lease`) goes back once
    the last piece is in the transport (the peer has taken the rest), or the peer has gone."""

    def __init__(self, body: bytes, lease):
        super().__init__(body, media_type="application/json")
        self._lease = lease

    async def __call__(self, scope, receive, send) -> None:
        body, self.body = self.body, b""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for begin in range(0, max(1, len(body)), ANSWER_PIECE_BYTES):
                end = begin + ANSWER_PIECE_BYTES
                await send({"type": "http.response.body", "body": body[begin:end], "more_body": end < len(body)})
        finally:
            self._lease.release()


def add_routes(app: FastAPI, completions: Completions, callers: Callers, ready) -> None:
    """The OpenAI-compatible routes, behind the teacher's tokens (`Authorization: Bearer`): a job
    token's requests run as its job, the operator's as the job "openai-api"."""

    @app.get("/health")
    async def health():
        return Response(status_code=200 if ready() else 503)

    @app.get("/v1/models")
    def models(authorization: str | None = Header(default=None)):
        if callers.caller(authorization) is None:
            return _error(ApiError("missing or wrong token (Authorization: Bearer <token>)", code=401,
                                   kind="AuthenticationError"))
        return {"object": "list", "data": [{
            "id": completions.model_id, "object": "model", "created": int(time.time()), "owned_by": "teacher-server",
            "root": completions.model_id, "parent": None, "max_model_len": completions.max_seq_len,
            "permission": []}]}

    @app.post("/v1/completions")
    async def complete(request: Request, authorization: str | None = Header(default=None)):
        caller = callers.caller(authorization)
        if caller is None:
            return _error(ApiError("missing or wrong token (Authorization: Bearer <token>)", code=401,
                                   kind="AuthenticationError"))
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (nested past Python's recursion limit)
            return _error(ApiError(f"the request body is not JSON: {str(e)[:200]}"))
        except ClientDisconnect:  # gone before its body came whole
            return Response(status_code=499)
        # uvicorn goes on with a handler whose client has gone: its wait for the budget and the
        # writer, and its forwards, would hold their places for an answer nobody reads.
        serving = asyncio.ensure_future(_serve(completions, caller, body))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({serving, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not serving.done():
                serving.cancel()  # its lease, if it has one, goes back as it ends
        if not serving.done():
            _clients_left_log.emit("a client left before its completion was answered: its request was dropped")
            return Response(status_code=499)  # sent nowhere: the client is gone
        return serving.result()


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (its body read, the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _serve(completions: Completions, caller, body) -> Response:
    """One completion: its answer, or its error in vLLM's shape."""
    lease = None
    try:
        params = await asyncio.to_thread(completions.parse, body)
        job = (caller.job_id or OPERATOR_JOB, caller.max_sessions, caller.limit("max_sessions"))
        lease = await completions.budget.reserve(job[0], params.answer_bytes)
        text = await completions.complete(params, job)
        answer, lease = _AnswerResponse(text, lease), None  # the answer gives the bytes back once sent
        return answer
    except ApiError as e:
        return _error(e)
    except AnswerTooLarge as e:
        return _error(ApiError(str(e), param="prompt"))
    except AnswerBudgetBusy as e:
        return _error(ApiError(str(e), code=503, kind="ServiceUnavailableError"))
    except ServiceError as e:
        code = _STATUS_CODES.get(e.code.name, 500)
        return _error(ApiError(str(e), code=code, kind="ServiceUnavailableError" if code == 503 else
                               "BadRequestError" if code < 500 else "InternalServerError"))
    except WriterBusy as e:
        return _error(ApiError(str(e), code=503, kind="ServiceUnavailableError"))
    except BatchFailed as e:
        if not completions.jobs.engine.accepting:  # its session ended with the teacher shutting down
            return _error(ApiError(f"the teacher is shutting down: {e}; retry on another", code=503,
                                   kind="ServiceUnavailableError"))
        return _error(ApiError(f"the teacher could not serve this request: {e}", code=500,
                               kind="InternalServerError"))
    except WriterFailed as e:
        return _error(ApiError(f"the teacher could not serve this request: {e}", code=500,
                               kind="InternalServerError"))
    finally:
        if lease is not None:  # failed (or cancelled) before its answer was made
            lease.release()


__all__ = ["Completions", "add_routes"]
