"""The JSON of `prompt_logprobs`, written in a process of its own.

Most of a scoring response is its prompt log-probabilities: k + 1 entries per position, 30 MB
for one 4,096-token prompt at k = 100, a few tenths of a second of CPU even written by numpy
(protocol.write_prompt_logprobs). In the teacher's process that work would hold the GIL, which
the engine thread takes back between every two of torch's operations, so another job's forward
would run slower while a response is written; and on a machine of few cores it would take a
core from the forward. Here a child process writes it (`python -m teacher_server.openai.writer`),
at a lower priority (nice `WRITER_NICE`): it shares no GIL with the engine, and the forwards get
the cores first.

The child is started at the first request and again if it dies (the request that found it dead
is written by the new one). Arrays go down its stdin raw (a JSON header line, then their bytes)
and the text comes back length-prefixed after a JSON header line: nothing is pickled. One request
at a time (a request waits at most `queue_timeout_s` for its turn: `WriterBusy`, a 503), the
turns going round the jobs whose requests wait (budget.FairPool): one job's queue of answers
delays another job's by one answer. The child exits when the teacher closes its stdin (or dies).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import numpy as np

from teacher_server.openai.budget import FairPool
from teacher_server.openai.protocol import TokenText, write_prompt_logprobs

log = logging.getLogger(__name__)

# The writer's niceness above the teacher's: the forwards' threads get the cores first.
WRITER_NICE = 10
# The arrays of one prompt, in the order they travel: name, dtype.
_ARRAYS = (("ids", np.int64), ("top", np.float32), ("top_ids", np.int64), ("own", np.float32), ("rank", np.int64),
           ("scored", np.float32), ("scored_ids", np.int64))


class WriterFailed(RuntimeError):
    """The writer process failed twice for one request (its message says why)."""


class WriterBusy(RuntimeError):
    """The writer was busy with other requests' answers for the whole of the queue's timeout."""


class JsonWriter:
    """The teacher's end: `prompt_logprobs(...)` returns the JSON text as bytes."""

    def __init__(self, text: TokenText, *, nice: int = WRITER_NICE, timeout_s: float = 300.0,
                 queue_timeout_s: float = 300.0):
        self._text = text
        self._nice = nice
        self._timeout_s = timeout_s  # for one answer: a stuck child fails the request, not the teacher
        self._proc: asyncio.subprocess.Process | None = None
        self.turns = FairPool(1, timeout_s=queue_timeout_s)  # one answer at a time, round the jobs

    async def prompt_logprobs(self, ids: list[int], top: np.ndarray, top_ids: np.ndarray, own: np.ndarray,
                              rank: np.ndarray, scored: np.ndarray | None = None,
                              scored_ids: np.ndarray | None = None, *, job: str = "") -> bytes:
        """`write_prompt_logprobs`'s text, encoded: [S, k] `top`/`top_ids`, [S] `own`/`rank`, and
        [S, m] `scored`/`scored_ids` (-1: none) or None; written in `job`'s turn."""
        arrays = {"ids": np.asarray(ids, dtype=np.int64), "top": top, "top_ids": top_ids, "own": own, "rank": rank,
                  "scored": scored, "scored_ids": scored_ids}
        try:
            turn = await self.turns.acquire(job, 1)
        except TimeoutError:
            raise WriterBusy(f"the JSON writer was busy with other requests' answers for {self.turns.timeout_s:g} s: "
                             "retry later, or ask for fewer prompt_logprobs or shorter prompts per request") from None
        try:
            for attempt in (1, 2):
                try:
                    return await asyncio.wait_for(self._ask(arrays), self._timeout_s)
                except WriterFailed:  # the child answered with its error: the exchange is whole
                    raise
                except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    reason = "no answer within %g s" % self._timeout_s if isinstance(e, asyncio.TimeoutError) else repr(e)
                    log.warning("the JSON writer process failed (%s); starting another", reason)
                    await self._stop()
                    if attempt == 2:
                        raise WriterFailed(f"the JSON writer process failed twice: {reason}") from e
                except BaseException:
                    # Cancelled mid-exchange: the child may hold half of these arrays or an answer
                    # not yet read, which the next request would take as its own. It goes.
                    self._discard()
                    raise
        finally:
            turn.release()
        raise AssertionError("unreachable")

    async def _ask(self, arrays: dict[str, np.ndarray | None]) -> bytes:
        proc = await self._started()
        header, payload = {}, []
        for name, dtype in _ARRAYS:
            value = arrays[name]
            if value is None:
                continue
            value = np.ascontiguousarray(value, dtype=dtype)
            header[name] = list(value.shape)
            payload.append(value.tobytes())
        proc.stdin.write(json.dumps(header).encode() + b"\n")
        proc.stdin.writelines(payload)
        await proc.stdin.drain()
        answer = json.loads(await proc.stdout.readline() or b"null")
        if answer is None:
            raise EOFError("the writer process closed its output")
        if "error" in answer:  # a fault in the writer itself: the same arrays would fail again
            raise WriterFailed(f"the JSON writer process failed: {answer['error']}")
        return await proc.stdout.readexactly(answer["bytes"])

    async def _started(self) -> asyncio.subprocess.Process:
        if self._proc is not None and self._proc.returncode is None:
            return self._proc
        from teacher_server.launcher import child_env

        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "teacher_server.openai.writer", str(self._nice), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=child_env())
        entries = json.dumps({"vocab_size": self._text.vocab_size, "entries": self._text.entries()}).encode()
        self._proc.stdin.write(b"%d\n" % len(entries) + entries)
        await self._proc.stdin.drain()
        return self._proc

    def _discard(self) -> None:
        """Kills the child without waiting for it (a cancelled task cannot wait): the next request
        starts another."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.kill()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            log.warning("the JSON writer process %d did not exit after SIGKILL within 10 s", proc.pid)

    async def close(self) -> None:
        """Ends the child: its stdin closed, then killed if it has not exited within 5 s."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:
            await self._stop()


# ---- the child ------------------------------------------------------------------------------------

def _read(stream, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"expected {size} bytes, got {len(data)}")
    return data


def main() -> None:
    os.nice(int(sys.argv[1]) if len(sys.argv) > 1 else WRITER_NICE)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    first = source.readline()
    if not first:
        return
    setup = json.loads(_read(source, int(first)))
    text = TokenText.of_entries([tuple(entry) for entry in setup["entries"]], setup["vocab_size"])
    text.arrays()
    while line := source.readline():
        shapes = json.loads(line)
        arrays = {}
        for name, dtype in _ARRAYS:
            if name in shapes:
                count = int(np.prod(shapes[name], dtype=np.int64))
                arrays[name] = np.frombuffer(_read(source, count * np.dtype(dtype).itemsize),
                                             dtype=dtype).reshape(shapes[name])
        try:
            scored_ids = arrays.get("scored_ids")
            written = write_prompt_logprobs(arrays["ids"].tolist(), arrays["top"], arrays["top_ids"], arrays["own"],
                                            arrays["rank"], arrays.get("scored"),
                                            None if scored_ids is None else scored_ids.tolist(), text).encode()
        except Exception as e:  # reported to the request, the child goes on
            sink.write(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        else:
            sink.write(json.dumps({"bytes": len(written)}).encode() + b"\n")
            sink.write(written)
        sink.flush()


if __name__ == "__main__":
    main()
