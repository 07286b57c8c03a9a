"""Prompt log-probabilities over vLLM's OpenAI API: teacher-server beside vLLM, and what the API's
requests do to another job's gRPC latency.

    python -m bench.openai_logprobs --vllm /tmp/vllmenv/bin/vllm --out openai.md     # CPU, both tables
    python -m bench.openai_logprobs --skip-latency                                  # throughput only, no vLLM

One tiny Llama with a realistic vocabulary (32,000 entries, a BPE tokenizer trained here; hidden
256, 4 layers, float32, random weights), built into --workdir, served by both. Four tables:

1. Throughput: `POST /v1/completions` with token-id prompts (fresh random ids each request, so no
   cache or prefix cache serves one), `max_tokens` 1, `prompt_logprobs` k, timed from the request
   to its parsed JSON (the client's parse counts: it is what a trainer waits for), --repeats
   times per (shape, k, server) with the servers alternated within each repeat, after one
   untimed request of each. Prompt tokens/s of the median, and teacher-server / vLLM. Before
   it, one request to both: the largest difference between their log-probabilities at the same
   ids (same weights: they should agree to ~1e-4), and whether the ids listed agree.
   vLLM is `vllm serve` (the CPU build, its own venv: --vllm) with --max-logprobs at the largest k,
   float32, prefix caching off, a batch-token budget as large as the teacher's; without --vllm
   its column says "not run". The teacher runs with torch's threads (--teacher-threads to set).
2. Another job's latency (teacher-server only): a gRPC job (TeacherClient, top-64 log-probabilities,
   --grpc-weight) submits one batch at a time, --grpc-think-s apart (a student's step; 0: back to
   back, a job that would take the whole teacher); its batch latency p50/p99 alone, then while a
   second process hammers `POST /v1/completions` as another job (weight 1) with the same prompts
   without `prompt_logprobs` (the forwards only), then with `prompt_logprobs` k (the forwards,
   the derive and the JSON of k entries per position). Phases are cycled --rounds times and
   pooled. Goal: p99 with the API job <= 1.5x alone.
   And the other way round: an API request's latency (`POST /v1/completions` of --api-shape with
   `prompt_logprobs` k, one at a time) alone, then while the gRPC job (in a process of its own)
   keeps --grpc-inflight batches submitted back to back, a job that would take the whole teacher.
   Goal: p99 <= 3x alone (its turn comes within the gRPC job's forward in progress and its
   share).
3. The JSON writers alone, in this process: the straightforward one against the server's.
4. The derive of the API's log-probabilities alone, in this process: a CPU's row chunks against
   a GPU's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import statistics
import string
import subprocess
import tempfile
import time
from pathlib import Path

import requests
import torch

from bench.table import emit
from teacher_server.launcher import ServerProcess, child_env, stop_process
from teacher_server.openai.protocol import TokenText, prompt_logprobs_json, write_prompt_logprobs

VOCAB = 32000
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=8192)
HTTP_TIMEOUT_S = 300.0


def build_model(directory: Path) -> Path:
    """The tokenizer (BPE of VOCAB entries trained on seeded random words) and a random Llama of as
    many entries, saved as one Hugging Face model directory; reused when it is there."""
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    from distill_demo.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    texts = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(3000)]
    tokenizer = train_tokenizer(texts, vocab_size=VOCAB, save_dir=directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL_SHAPE)
    LlamaForCausalLM(config).float().save_pretrained(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` in a child process, its output in `log_path`; ready once /health answers 200."""

    def __init__(self, vllm: str, model: Path, *, max_logprobs: int, max_model_len: int, log_path: Path,
                 startup_timeout_s: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # The CPU build's own defaults otherwise (its thread binding: one core for compute per rank
        # and the rest reserved for the API server, on a 2-core machine one and one).
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env.pop("PYTHONPATH", None)  # vLLM's venv, not this project's imports
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [vllm, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--max-logprobs", str(max_logprobs), "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", str(max_model_len), "--no-enable-prefix-caching"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; its output:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not answer /health within {timeout_s:g} s (--vllm-startup-timeout-s); "
                           f"its output:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=60)
        self._log.close()


def _prompts(seed: int, rows: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(rows)]


def _body(model: str, prompts: list[list[int]], k: int | None) -> bytes:
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0}
    if k is not None:
        body["prompt_logprobs"] = k
    return json.dumps(body).encode()


def _complete(session: requests.Session, url: str, body: bytes) -> tuple[float, float, dict, int]:
    """Seconds from the request to its parsed JSON, seconds to the answer's first bytes (the
    server's own work: both write the whole JSON before sending it), the JSON, its bytes."""
    start = time.perf_counter()
    response = session.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"},
                            timeout=HTTP_TIMEOUT_S, stream=True)
    chunks = response.iter_content(1 << 20)
    content = next(chunks, b"")
    first_byte_s = time.perf_counter() - start
    content += b"".join(chunks)
    parsed = json.loads(content)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {content[:2000]!r}")
    return seconds, first_byte_s, parsed, len(content)


def _model_id(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _shape(text: str) -> tuple[int, int]:
    rows, length = text.lower().split("x")
    return int(rows), int(length)


# ---- 1. throughput, side by side ------------------------------------------------------------------

def cross_check(servers: dict[str, str], models: dict[str, str], vocab: int, length: int, k: int) -> list[str]:
    """One prompt to every server: the largest |difference| of the log-probabilities both list at
    the same position and id, how many positions list different ids, and ranks that differ."""
    prompt = _prompts(12345, 1, length, vocab)
    got = {}
    for name, url in servers.items():
        with requests.Session() as session:
            got[name] = _complete(session, url, _body(models[name], prompt, k))[2]["choices"][0]["prompt_logprobs"]
    names = list(got)
    if len(names) < 2:
        return [f"Cross-check: only {names[0]} ran; nothing to compare."]
    a, b = got[names[0]], got[names[1]]
    largest, id_mismatches, rank_mismatches, rank_gap, compared = 0.0, 0, 0, 0, 0
    for t in range(1, len(prompt[0])):
        if set(a[t]) != set(b[t]):
            id_mismatches += 1
        for token in set(a[t]) & set(b[t]):
            compared += 1
            largest = max(largest, abs(a[t][token]["logprob"] - b[t][token]["logprob"]))
            rank_mismatches += a[t][token]["rank"] != b[t][token]["rank"]
            if a[t][token]["rank"] is not None and b[t][token]["rank"] is not None:
                rank_gap = max(rank_gap, abs(a[t][token]["rank"] - b[t][token]["rank"]))
    return [f"Cross-check, one {length}-token prompt at k = {k}: {compared} (position, id) log-probabilities "
            f"listed by both; largest |{names[0]} - {names[1]}| = {largest:.2e}; positions listing different "
            f"ids: {id_mismatches} of {len(prompt[0]) - 1}; ranks that differ: {rank_mismatches} (by at most "
            f"{rank_gap}: ranks among near-equal log-probabilities); position 0 "
            f"null in both: {a[0] is None and b[0] is None}."]


def throughput(servers: dict[str, str], models: dict[str, str], shapes: list[tuple[int, int]], ks: list[int],
               repeats: int, vocab: int) -> tuple[list[str], dict]:
    names = list(servers)
    times: dict = {}
    first_bytes: dict = {}
    sizes: dict = {}
    seed = 0
    with requests.Session() as session:
        for shape in shapes:
            for k in ks:
                for name in names:  # untimed: first requests of a shape warm both up
                    seed += 1
                    _complete(session, servers[name], _body(models[name], _prompts(seed, *shape, vocab), k))
        for repeat in range(repeats):
            for shape in shapes:
                for k in ks:
                    order = names if repeat % 2 == 0 else names[::-1]
                    for name in order:
                        seed += 1
                        body = _body(models[name], _prompts(seed, *shape, vocab), k)
                        seconds, first_byte_s, _, size = _complete(session, servers[name], body)
                        times.setdefault((shape, k, name), []).append(seconds)
                        first_bytes.setdefault((shape, k, name), []).append(first_byte_s)
                        sizes[(shape, k, name)] = size
    lines = ["| prompts | k | " + " | ".join(f"{n} tokens/s (median s; to first byte; MB)" for n in names) +
             (f" | {names[0]} / {names[1]} |" if len(names) > 1 else " |"),
             "|---|---|" + "---|" * len(names) + ("---|" if len(names) > 1 else "")]
    figures = []
    for shape in shapes:
        for k in ks:
            tokens = shape[0] * shape[1]
            rates = {}
            cells = []
            for name in names:
                median = statistics.median(times[(shape, k, name)])
                rates[name] = tokens / median
                first = statistics.median(first_bytes[(shape, k, name)])
                cells.append(f"{rates[name]:,.0f} ({median:.2f} s; {first:.2f} s; "
                             f"{sizes[(shape, k, name)] / 1e6:.1f} MB)")
                figures.append({"shape": list(shape), "k": k, "server": name, "seconds": times[(shape, k, name)],
                                "first_byte_s": first_bytes[(shape, k, name)], "bytes": sizes[(shape, k, name)]})
            ratio = f" | {rates[names[0]] / rates[names[1]]:.2f}x" if len(names) > 1 else ""
            lines.append(f"| {shape[0]} x {shape[1]} | {k} | " + " | ".join(cells) + ratio + " |")
    return lines, {"throughput": figures}


# ---- 2. another job's latency ----------------------------------------------------------------------

def _hammer(url: str, model: str, rows: int, length: int, vocab: int, k: int | None, stop, done) -> None:
    """In its own process (its client work takes no GIL of the measuring one): requests back to
    back until `stop`, each read whole (not parsed: a trainer elsewhere would parse it)."""
    seed = 10_000
    with requests.Session() as session:
        while not stop.is_set():
            seed += 1
            response = session.post(f"{url}/v1/completions", data=_body(model, _prompts(seed, rows, length, vocab), k),
                                    headers={"Content-Type": "application/json"}, timeout=HTTP_TIMEOUT_S)
            if response.status_code != 200:
                raise RuntimeError(f"the API job's request failed: {response.status_code} {response.text[:500]}")
            with done.get_lock():
                done.value += 1


def _grpc_latencies(teacher, batches: int, rows: int, length: int, vocab: int, seed: int,
                    think_s: float = 0.0) -> list[float]:
    """Seconds from submitting each batch to its outputs, one batch at a time, `think_s` between
    them (a student's training step: 0 submits back to back, a job that wants the whole teacher)."""
    generator = torch.Generator().manual_seed(seed)
    latencies = []
    for _ in range(batches):
        ids = torch.randint(0, vocab, (rows, length), generator=generator)
        start = time.perf_counter()
        teacher.submit(ids).result(timeout=HTTP_TIMEOUT_S)
        latencies.append(time.perf_counter() - start)
        time.sleep(think_s)
    return latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def latency(server: ServerProcess, model: str, vocab: int, grpc_shape: tuple[int, int],
            http_shape: tuple[int, int], k: int, batches: int, rounds: int, think_s: float = 0.0,
            weight: float = 1.0) -> tuple[list[str], dict]:
    from distill_common.outputs import TopK
    from student_trainer import TeacherClient

    url = f"http://127.0.0.1:{server.http_port}"
    phases = {"alone": None, "API job, no prompt_logprobs": "forward", f"API job, prompt_logprobs {k}": k}
    results: dict[str, list[float]] = {name: [] for name in phases}
    requests_done: dict[str, int] = {name: 0 for name in phases}
    spent: dict[str, float] = {name: 0.0 for name in phases}
    context = multiprocessing.get_context("spawn")
    with TeacherClient(server.address, "cpu", outputs=(TopK(64),), job_id="grpc-job", join_timeout_s=120,
                       weight=weight) as teacher:
        _grpc_latencies(teacher, 3, *grpc_shape, vocab, seed=0)  # warm-up: session, group, first forwards
        seed = 1
        for _ in range(rounds):
            for name, what in phases.items():
                stop, done, hammer = context.Event(), context.Value("i", 0), None
                if what is not None:
                    hammer = context.Process(target=_hammer, daemon=True, args=(
                        url, model, *http_shape, vocab, None if what == "forward" else what, stop, done))
                    hammer.start()
                    deadline = time.monotonic() + HTTP_TIMEOUT_S
                    while done.value < 1:  # its first request served: it is running
                        if not hammer.is_alive() or time.monotonic() > deadline:
                            raise RuntimeError("the API job's first request did not complete "
                                               f"within {HTTP_TIMEOUT_S:g} s (or its process died)")
                        time.sleep(0.05)
                    start_done = done.value
                start = time.perf_counter()
                results[name] += _grpc_latencies(teacher, batches, *grpc_shape, vocab, seed, think_s)
                spent[name] += time.perf_counter() - start
                seed += 1
                if hammer is not None:
                    requests_done[name] += done.value - start_done
                    _stop(hammer, stop, "the API job did not stop within its request timeout")
    rates = {name: requests_done[name] / spent[name] for name in phases if phases[name] is not None}
    lines = _latency_table(("gRPC job's batches", "batches", "API requests/s"), results, rates)
    return lines, {"latency": {name: values for name, values in results.items()}}


def _stop(process, stop, what: str) -> None:
    """Tells a load process to stop and waits for it (killed, and `what` raised, past the timeout)."""
    stop.set()
    process.join(timeout=HTTP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        raise RuntimeError(what)


def _latency_table(heads: tuple[str, str, str], results: dict[str, list[float]], rates: dict[str, float]) -> list[str]:
    """Each phase's latencies (the first phase is "alone"), against alone, and the other job's rate."""
    alone = results["alone"]
    lines = [f"| {heads[0]} | {heads[1]} | p50 s | p99 s | p50 / alone | p99 / alone | {heads[2]} |",
             "|---|---|---|---|---|---|---|"]
    for name, values in results.items():
        rate = f"{rates[name]:.2f}" if name in rates else "-"
        lines.append(f"| {name} | {len(values)} | {statistics.median(values):.3f} | {_percentile(values, 0.99):.3f} | "
                     f"{statistics.median(values) / statistics.median(alone):.2f}x | "
                     f"{_percentile(values, 0.99) / _percentile(alone, 0.99):.2f}x | {rate} |")
    return lines


def _saturate(address: str, rows: int, length: int, vocab: int, inflight: int, stop, done) -> None:
    """In its own process: a gRPC job (top-64) that keeps `inflight` batches submitted until `stop`."""
    from collections import deque

    from distill_common.outputs import TopK
    from student_trainer import TeacherClient

    generator = torch.Generator().manual_seed(20_000)
    with TeacherClient(address, "cpu", outputs=(TopK(64),), job_id="grpc-saturating", join_timeout_s=120) as teacher:
        pending: deque = deque()
        while not stop.is_set():
            while len(pending) < inflight:
                pending.append(teacher.submit(torch.randint(0, vocab, (rows, length), generator=generator)))
            pending.popleft().result(timeout=HTTP_TIMEOUT_S)
            with done.get_lock():
                done.value += 1
        for future in pending:
            future.result(timeout=HTTP_TIMEOUT_S)


def api_latency(server: ServerProcess, model: str, vocab: int, grpc_shape: tuple[int, int],
                http_shape: tuple[int, int], k: int, count: int, rounds: int, inflight: int) -> tuple[list[str], dict]:
    """An API request's seconds, one at a time, alone and while a gRPC job saturates the teacher."""
    url = f"http://127.0.0.1:{server.http_port}"
    phases = {"alone": 0, f"gRPC job, {inflight} batches in flight back to back": inflight}
    results: dict[str, list[float]] = {name: [] for name in phases}
    grpc_done: dict[str, int] = {name: 0 for name in phases}
    spent: dict[str, float] = {name: 0.0 for name in phases}
    context = multiprocessing.get_context("spawn")
    seed = 30_000
    with requests.Session() as session:
        _complete(session, url, _body(model, _prompts(seed, *http_shape, vocab), k))  # warm-up
        for _ in range(rounds):
            for name, depth in phases.items():
                stop, done, job = context.Event(), context.Value("i", 0), None
                if depth:
                    job = context.Process(target=_saturate, daemon=True,
                                          args=(server.address, *grpc_shape, vocab, depth, stop, done))
                    job.start()
                    deadline = time.monotonic() + HTTP_TIMEOUT_S
                    while done.value < 2:  # its session formed and batches flowing
                        if not job.is_alive() or time.monotonic() > deadline:
                            raise RuntimeError(f"the gRPC job served no batch within {HTTP_TIMEOUT_S:g} s "
                                               "(or its process died)")
                        time.sleep(0.05)
                start_done, start = done.value, time.perf_counter()
                for _ in range(count):
                    seed += 1
                    results[name].append(_complete(session, url, _body(model, _prompts(seed, *http_shape, vocab),
                                                                        k))[0])
                spent[name] += time.perf_counter() - start
                if job is not None:
                    grpc_done[name] += done.value - start_done
                    _stop(job, stop, "the gRPC job did not stop within its batch timeout")
    rates = {name: grpc_done[name] / spent[name] for name in phases if phases[name]}
    return _latency_table(("API requests", "requests", "gRPC batches/s"), results, rates), {"api_latency": results}


# ---- 3. the JSON writer, alone -----------------------------------------------------------------------

def writers(model_dir: Path, vocab: int, length: int, ks: list[int], repeats: int) -> list[str]:
    """Seconds to write one prompt's `prompt_logprobs` from the derived tensors (a real
    log_softmax of random logits): the straightforward writer (an f-string per entry, from
    `.tolist()`s) against the server's (`write_prompt_logprobs`, from the arrays), their texts
    checked equal."""
    from transformers import PreTrainedTokenizerFast

    text = TokenText(PreTrainedTokenizerFast.from_pretrained(model_dir), vocab)
    text.arrays()  # made once per teacher, at its first request
    generator = torch.Generator().manual_seed(0)
    lines = [f"| k | {length}-token prompt: straightforward writer s | server's writer s | speed-up | MB |",
             "|---|---|---|---|---|"]
    for k in ks:
        logprobs = torch.randn(length, vocab, generator=generator).log_softmax(-1)
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        ids[2] = int(logprobs[1].argmax())  # one prompt token among the top k, listed once
        top, top_ids = logprobs.topk(k, dim=1)
        nxt = torch.tensor(ids[1:] + ids[-1:])
        own = logprobs.gather(1, nxt[:, None])[:, 0]
        rank = (logprobs >= own[:, None]).sum(1)
        candidates = {
            "straightforward": lambda: prompt_logprobs_json(ids, top.tolist(), top_ids.tolist(), own.tolist(),
                                                            rank.tolist(), None, None, text),
            "server": lambda: write_prompt_logprobs(ids, top.numpy(), top_ids.numpy(), own.numpy(), rank.numpy(),
                                                    None, None, text)}
        seconds, texts = {}, {}
        for _ in range(repeats):
            for name, write in candidates.items():
                start = time.perf_counter()
                texts[name] = write()
                seconds.setdefault(name, []).append(time.perf_counter() - start)
        if texts["server"] != texts["straightforward"]:
            raise AssertionError("the server's writer's text differs from the straightforward one's")
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        lines.append(f"| {k} | {medians['straightforward']:.3f} | {medians['server']:.3f} | "
                     f"{medians['straightforward'] / medians['server']:.1f}x | {len(texts['server']) / 1e6:.1f} |")
    return lines


# ---- 4. the derive, alone -------------------------------------------------------------------------------

def derives(vocab: int, length: int, ks: list[int], repeats: int) -> list[str]:
    """Seconds of `CompletionLogprobs.derive` (log-softmax, top-k, each position's own log-probability
    and rank) over [1, length, vocab] float32 logits, in this process, with the row chunks a CPU
    running torch on one thread gets (`rows_per_chunk`) against chunks of 256 MiB, on this
    process's torch threads (--derive-threads)."""
    from types import SimpleNamespace

    from distill_common.outputs import logprobs
    from teacher_server.openai.outputs import CompletionLogprobs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, length, vocab, generator=generator) * 3
    ids = torch.randint(0, vocab, (1, length), generator=generator)
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), data={})
    cpu_chunk, gpu_chunk = logprobs._CPU_CHUNK_BYTES, logprobs._LOGPROB_CHUNK_BYTES
    lines = [f"| k | {length} x {vocab:,} logits: {gpu_chunk >> 20} MiB chunks s | {cpu_chunk >> 20} MiB chunks s |",
             "|---|---|---|"]
    for k in ks:
        kind = CompletionLogprobs(prompt_k=k, last=True)
        seconds = {}
        try:
            for _ in range(repeats):
                for chunk in (gpu_chunk, cpu_chunk):
                    logprobs._CPU_CHUNK_BYTES = logprobs._LOGPROB_CHUNK_BYTES = chunk
                    start = time.perf_counter()
                    kind.derive(SimpleNamespace(logits=logits), batch, torch.float32)
                    seconds.setdefault(chunk, []).append(time.perf_counter() - start)
        finally:
            logprobs._CPU_CHUNK_BYTES, logprobs._LOGPROB_CHUNK_BYTES = cpu_chunk, gpu_chunk
        lines.append(f"| {k} | " + " | ".join(f"{statistics.median(v):.3f}" for v in seconds.values()) + " |")
    return lines


def served(args, model_dir: Path, vocab: int, ks: list[int], shapes: list[tuple[int, int]],
           max_len: int) -> tuple[list[str], dict]:
    """Tables 1 and 2: the servers started, measured, stopped."""
    lines, figures = [], {}
    workdir = Path(args.workdir)
    with ServerProcess("--model", str(model_dir), "--max-logprobs", str(max(ks + [args.api_k])), "--max-seq-len",
                       str(max_len), "--max-batch-tokens", str(max_len), "--log-format", "json",
                       *(["--api-chunk-tokens", str(args.api_chunk_tokens)] if args.api_chunk_tokens >= 0 else []),
                       log_path=workdir / "teacher.log",
                       env=child_env(**({"OMP_NUM_THREADS": str(args.teacher_threads)} if args.teacher_threads else {}))
                       ) as teacher:
        teacher_url = f"http://127.0.0.1:{teacher.http_port}"
        if not args.skip_throughput:
            servers = {"teacher-server": teacher_url}
            vllm = None
            if args.vllm:
                vllm = VllmServer(args.vllm, model_dir, max_logprobs=max(ks), max_model_len=max_len,
                                  log_path=workdir / "vllm.log", startup_timeout_s=args.vllm_startup_timeout_s)
                servers["vLLM"] = vllm.url
            try:
                models = {name: _model_id(url) for name, url in servers.items()}
                check = cross_check(servers, models, vocab, args.check_tokens, ks[0])
                table, figures_1 = throughput(servers, models, shapes, ks, args.repeats, vocab)
            finally:
                if vllm is not None:
                    vllm.stop()
            figures.update(figures_1)
            lines += [f"Prompt log-probabilities over `POST /v1/completions`, `max_tokens` 1, request to parsed JSON, "
                      f"median of {args.repeats} (servers alternated), CPU; a Llama of vocabulary {vocab:,}, hidden "
                      f"256, 4 layers, float32 (`python -m bench.openai_logprobs"
                      f"{' --vllm ' + args.vllm if args.vllm else ''}`):", "", *table, "",
                      *([] if args.vllm else ["vLLM: not run (no --vllm)", ""]), *check, ""]
        if not args.skip_latency:
            table, figures_2 = latency(teacher, _model_id(teacher_url), vocab, _shape(args.grpc_shape),
                                       _shape(args.api_shape), args.api_k, args.batches, args.rounds,
                                       args.grpc_think_s, args.grpc_weight)
            figures.update(figures_2)
            lines += [f"A gRPC job's batch latency ({args.grpc_shape} tokens, top-64 log-probabilities, one batch at "
                      f"a time, {args.grpc_think_s:g} s between batches, weight {args.grpc_weight:g}) while another "
                      f"job (weight 1) sends `POST /v1/completions` of {args.api_shape} tokens back to back from "
                      f"another process, {args.rounds} rounds x {args.batches} batches per phase:", "", *table, ""]
        if not args.skip_api_latency:
            table, figures_3 = api_latency(teacher, _model_id(teacher_url), vocab, _shape(args.grpc_shape),
                                           _shape(args.api_shape), args.api_k, args.api_requests, args.rounds,
                                           args.grpc_inflight)
            figures.update(figures_3)
            lines += [f"An API job's latency (`POST /v1/completions` of {args.api_shape} tokens, `prompt_logprobs` "
                      f"{args.api_k}, one request at a time, weight 1) while a gRPC job (weight 1, {args.grpc_shape} "
                      f"tokens, top-64) keeps {args.grpc_inflight} batches in flight from another process, "
                      f"{args.rounds} rounds x {args.api_requests} requests per phase:", "", *table, ""]
    return lines, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="", help="the `vllm` command of vLLM's own venv (e.g. /tmp/vllmenv/bin/vllm)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "openai_logprobs_bench"),
                        help="where the model is built (kept, reused) and the servers' logs go")
    parser.add_argument("--ks", default="20,100", help="prompt_logprobs values, a comma list")
    parser.add_argument("--shapes", default="1x4096,8x512", help="prompts per request x tokens each, a comma list")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-tokens", type=int, default=512, help="the cross-check prompt's length")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-writers", action="store_true")
    parser.add_argument("--skip-derive", action="store_true")
    parser.add_argument("--derive-threads", default="1,2", help="torch threads of the derive table, a comma list")
    parser.add_argument("--grpc-shape", default="4x256", help="the gRPC job's batches")
    parser.add_argument("--api-shape", default="1x4096", help="the API job's requests")
    parser.add_argument("--api-k", type=int, default=100)
    parser.add_argument("--teacher-threads", type=int, default=0,
                        help="the teacher's torch threads (OMP_NUM_THREADS; 0: torch's default, a thread per core). "
                             "vLLM's CPU build gives its model one core of two and its API server the other")
    parser.add_argument("--api-chunk-tokens", type=int, default=-1,
                        help="the teacher's --api-chunk-tokens (default: the teacher's own default)")
    parser.add_argument("--batches", type=int, default=30, help="gRPC batches per phase per round")
    parser.add_argument("--grpc-think-s", type=float, default=0.0,
                        help="the gRPC job's pause between batches (its student's step; 0: back to back)")
    parser.add_argument("--grpc-weight", type=float, default=1.0, help="the gRPC job's weight")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-api-latency", action="store_true")
    parser.add_argument("--api-requests", type=int, default=10, help="API requests per phase per round")
    parser.add_argument("--grpc-inflight", type=int, default=4,
                        help="batches the saturating gRPC job keeps in flight")
    parser.add_argument("--vllm-startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    shapes = [_shape(s) for s in args.shapes.split(",")]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(workdir / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_len = 2 * max([rows * length for rows, length in shapes + [_shape(args.api_shape)]] + [args.check_tokens])
    lines, figures = [], {}
    load = os.getloadavg()
    if not (args.skip_throughput and args.skip_latency and args.skip_api_latency):
        lines, figures = served(args, model_dir, vocab, ks, shapes, max_len)
    if not args.skip_writers:
        lines += [f"The JSON writer alone, in this process, median of {args.repeats}:", "",
                  *writers(model_dir, vocab, max(length for _, length in shapes), ks, args.repeats), ""]
    if not args.skip_derive:
        for threads in (int(t) for t in args.derive_threads.split(",")):
            torch.set_num_threads(threads)
            lines += [f"The derive of the API's log-probabilities alone, in this process ({threads} torch "
                      f"thread{'s' if threads > 1 else ''}), median of {args.repeats}:", "",
                      *derives(vocab, max(length for _, length in shapes), ks, args.repeats), ""]
    end_load = os.getloadavg()
    lines.append(f"Load average (1 min) at start {load[0]:.2f}, at end {end_load[0]:.2f}; {os.cpu_count()} CPUs.")
    emit(lines, args.out, figures)


if __name__ == "__main__":
    main()
