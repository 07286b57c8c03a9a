"""The teacher server's settings: one dataclass, checked once, errors that name the flag.

`python -m teacher_server` generates its command line from these fields
(distill_common/settings.py): a field's help text is its flag's. The bounds derived from
them and from the model (a 0 that means "derived") are teacher_server/limits.py's.
"""

from __future__ import annotations

import json
import math
import os
import ssl
from dataclasses import dataclass, field
from typing import Literal

from distill_common.channel import read_pem
from distill_common.settings import LOG_LEVELS, ByteCount, ConfigError, check_choices, flag
from teacher_server.limits import DEFAULT_MAX_SEQ_LEN, HELD_MEMORY_SHARE, ServerLimits


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class ServerConfig(ServerLimits):
    model: str = field(default="builtin:tiny", metadata=_help(
        "a local Hugging Face model directory, a hub id, or builtin:tiny (a small random Llama)"))
    device: str = field(default="cpu", metadata=_help("cpu, cuda or cuda:N"))
    dtype: Literal["", "float32", "bfloat16", "float16"] = field(default="", metadata=_help(
        "the dtype to run the model in (default: the model's)"))
    host: str = field(default="0.0.0.0", metadata=_help("address the gRPC and HTTP servers bind to"))
    port: int = field(default=50051, metadata=_help("gRPC port (0: any free port)"))
    http_port: int = field(default=8000, metadata=_help("HTTP port: health, metrics, status (0: any free port)"))
    advertise_host: str = field(default="", metadata=_help(
        "address students reach the data plane at (gloo binds the teacher's end there; default: this machine's "
        "hostname, or 127.0.0.1 when --host is loopback)"))
    max_batch_tokens: int = field(default=16384, metadata=_help(
        "token budget of one forward (rows x padded length), and the largest batch accepted"))
    max_seq_len: int = field(default=0, metadata=_help(
        "longest sequence accepted (0: the model's position limit where it has one, e.g. GPT-2's learned "
        f"n_positions, else {DEFAULT_MAX_SEQ_LEN}; never more than --max-batch-tokens). A longer value than the "
        "model's limit is refused"))
    max_sessions: int = field(default=64, metadata=_help("sessions served at once"))
    max_inflight: int = field(default=8, metadata=_help("batches a session may have queued or in transfer"))
    # Held in teacher memory, on the teacher's device: see docs/scaling.md.
    cache_bytes: ByteCount = field(default=0, metadata={"metavar": "BYTES", "help": (
        "keep up to this many bytes of outputs (e.g. 8GiB) so identical batches of later sessions cost no "
        "forward; held on the teacher device (0: off)")})
    cuda_graphs: int = field(default=0, metadata={"metavar": "N", "help": (
        "replay the model's decoder from CUDA graphs (teacher_server/cuda_graphs.py) for up to N pack shapes: "
        "for small teachers whose forward costs the host more than the device (one GPU, no tensor "
        "parallelism; 0: off)")})
    quantize: Literal["", "fp8"] = field(default="", metadata=_help(
        "fp8: quantize the decoder's linear layers to FP8 (e4m3) at load and run them through torch._scaled_mm "
        "(1.6x the bf16 forward of an 8B model on an H200, docs/performance.md); the embedding, norms, attention "
        "and output head keep --dtype; at start-up the teacher measures the KL this costs it (--fp8-calibration, "
        "--fp8-max-kl). Needs a GPU of compute capability 8.9+ (CPU: row scaling only, for tests). "
        "A published FP8 checkpoint (quantization_config in config.json) is served in FP8 without this flag"))
    fp8_scaling: Literal["row", "block"] = field(default="row", metadata=_help(
        "--quantize fp8 scales: row (one per output channel of a weight, one per token of an activation) or "
        "block (128 x 128 weight tiles, 1 x 128 activation blocks: finer, slower; compute capability 9.0)"))
    fp8_keep_layers: str = field(default="", metadata={"metavar": "I,J", "help": (
        "--quantize fp8: decoder layers (0-based; -1 the last) whose linears keep --dtype, e.g. 0,-1")})
    fp8_fast_accum: bool = field(default=False, metadata=_help(
        "--quantize fp8 with row scales: accumulate the FP8 products with cuBLAS's fast accumulation (no float32 "
        "promotion along K, as torchao's row-wise float8 does by default): 1.07x the FP8 forward of an 8B model "
        "on an H200, the same KL to bf16 on the model measured (docs/performance.md); an MoE model's FP8 experts "
        "too (the tensor cores' partial sums over the whole K: 1.31x bf16 for a Qwen3-30B-A3B-shaped forward "
        "against 1.02x without); students see it"))
    fp8_calibration: str = field(default="", metadata={"metavar": "FILE", "help": (
        "--quantize fp8: UTF-8 text the teacher measures what FP8 costs it on at start-up (KL to the model in "
        "--dtype per token, top-1 agreement; in the join answer, /v1/status, teacher-server info and the log), "
        "and computes the bias correction on (default: a built-in sample of English prose and Python source)")})
    fp8_calibration_rows: int = field(default=4, metadata=_help(
        "--quantize fp8: sequences in the start-up calibration batch (0: nothing measured, no bias correction; "
        "under tensor parallelism nothing is measured)"))
    fp8_calibration_seq: int = field(default=256, metadata=_help(
        "--quantize fp8: tokens per sequence of the start-up calibration batch"))
    fp8_max_kl: float = field(default=0.0, metadata=_help(
        "--quantize fp8: the most KL (nats per token, on the calibration batch) the teacher may add; the linears "
        "that cost the most KL per FLOP stay in --dtype until the measured KL is at most this (0: no bound). "
        "docs/performance.md gives SmolLM2-135M's KL against the share of FLOPs in FP8"))
    fp8_bias_correction: Literal["on", "off"] = field(default="on", metadata=_help(
        "--quantize fp8: add each FP8 linear's weight rounding error on the calibration batch's mean input to its "
        "bias (no cost at run time; KL 3.2e-2 -> 2.8e-2 on SmolLM2-135M, docs/performance.md)"))
    fp8_compile: Literal["auto", "layers", "quantize", "off"] = field(default="auto", metadata=_help(
        "how FP8 layers are compiled: layers (each decoder layer, so the activation quantization fuses into the "
        "norm or product before it), quantize (the quantization alone), off (eager: slower than bf16); auto: "
        "layers on one GPU, quantize under tensor parallelism, off on CPU"))
    heartbeat_interval_s: float = field(default=2.0, metadata=_help(
        "students send a heartbeat this often (told at join)"))
    lease_s: float = field(default=30.0, metadata=_help("a session without a heartbeat for this long is dropped"))
    transfer_timeout_s: float = field(default=120.0, metadata=_help(
        "a send to a student that takes longer fails that session"))
    # A join that never forms its group holds a --max-sessions slot until this ends it. Real
    # ones form far sooner: within 0.03 s on CPU (gloo) under load, bench/connect_time.py and
    # docs/security.md; NCCL adds its communicator's set-up.
    join_timeout_s: float = field(default=20.0, metadata=_help(
        "a joined session whose process group has not formed within this long of its Join is ended and its "
        "slot freed"))
    session_transport: Literal["process", "inline"] = field(default="process", metadata=_help(
        "where the teacher's end of each session's process group lives: process (a process of its own per "
        "session, which a hostile or broken student can at worst end: the teacher and other sessions go on; a "
        "fork per join, and for an NCCL session a CUDA context of its own, 518 MiB on an H200) or inline (in the "
        "teacher's process: a student can crash the teacher through its data plane; only where every student is "
        "trusted). docs/security.md"))
    grace_period_s: float = field(default=30.0, metadata=_help(
        "on SIGTERM, how long in-flight batches may take to finish"))
    # Long: loading a large model shard by shard waits for the slowest rank under it too.
    tp_timeout_s: float = field(default=1800.0, metadata=_help(
        "tensor parallelism (torchrun, several ranks): a collective or a rank's wait for rank 0's next message "
        "(keep-alives keep it fed) that takes longer fails the teacher"))
    trust_remote_code: bool = field(default=False, metadata=_help("allow model code from the hub"))
    # repr=False: a secret, kept out of reprs and logged as "(set)".
    auth_token: str = field(default_factory=lambda: os.environ.get("TEACHER_AUTH_TOKEN", ""), repr=False,
                            metadata=_help("require this shared token on every RPC but health, and on /v1/status "
                                           "(default: $TEACHER_AUTH_TOKEN; empty: no authentication)"))
    tls_cert: str = field(default="", metadata=_help(
        "PEM certificate chain: serve gRPC and HTTP over TLS (needs --tls-key)"))
    tls_key: str = field(default="", metadata=_help("PEM private key of --tls-cert"))
    tls_client_ca: str = field(default="", metadata=_help(
        "PEM CA bundle: gRPC clients must present a certificate it signed (mutual TLS)"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING, ERROR or CRITICAL"))
    log_format: Literal["text", "json"] = field(default="text", metadata=_help(
        "json: one JSON object per line, with session_id on session records"))
    # Bounds on what a caller can hold, most of them before its token is checked
    # (teacher_server/edge.py, docs/security.md).
    max_request_bytes: ByteCount = field(default=0, metadata={"metavar": "BYTES", "help": (
        "largest gRPC request accepted (bigger ones: RESOURCE_EXHAUSTED from grpc; 0: what a batch of "
        "--max-batch-tokens needs, or a Join whose logit subset is the whole vocabulary, whichever is larger)")})
    # Room for a reconnecting student whose old stream has not ended yet.
    max_streams: int = field(default=0, metadata=_help(
        "submit streams (and grpc.health Watch streams) open at once with the operator's token (every caller "
        "without a job token); a job's: 2 per session it may hold, at most this (0: 2 x --max-sessions)"))
    max_rpcs: int = field(default=0, metadata=_help(
        "other calls in progress at once with the operator's token (heartbeats and leaves as many again), the "
        "most --max-job-rpcs may be, and health checks waiting for their request (0: 4 x --max-sessions + 16)"))
    # Heartbeat and Leave of a job draw from a budget of their own (of the same size), so that
    # the job's other calls cannot stop its sessions' upkeep.
    max_job_rpcs: int = field(default=0, metadata=_help(
        "calls other than streams one job (by its job token) may have in progress at once, its heartbeats and "
        "leaves as many again apart; other jobs' and the operator's calls have budgets of their own "
        "(0: 4 x the job's max_sessions + 16, at most --max-rpcs)"))
    request_timeout_s: float = field(default=10.0, metadata=_help(
        "a unary gRPC call whose request has not arrived within this long of its headers is refused"))
    # A connection without a call holds a descriptor and ~14 KiB of grpc's memory; it is closed
    # after this (grpc.max_connection_idle_ms), one that never completes its handshake too.
    grpc_idle_timeout_s: float = field(default=10.0, metadata=_help(
        "close a gRPC connection that has had no call in progress for this long (clients reconnect on their "
        "next call), or that has not finished its handshake within this long"))
    grpc_max_connections: int = field(default=0, metadata=_help(
        "gRPC connections open at once; past it new ones are closed at once (0: 8192, at most the descriptor "
        "limit, raised to its hard limit at start-up, less what HTTP, health and the sessions' data planes need)"))
    grpc_max_streams_per_connection: int = field(default=256, metadata=_help(
        "calls in progress on one gRPC connection (grpc.max_concurrent_streams)"))
    # Past the cap the oldest connection without a complete request closes, so idle sockets cannot lock probes out.
    http_max_connections: int = field(default=64, metadata=_help(
        "HTTP connections open at once; a new one closes the oldest one without a complete request"))
    http_header_timeout_s: float = field(default=10.0, metadata=_help(
        "close a HTTP connection that has not sent a whole request (headers and body) within this long of "
        "opening (or of its previous response)"))
    # The teacher's socket buffer full and its answer waiting: without a bound a peer that
    # pipelines requests and never reads holds a connection (and a request in progress) for good.
    http_send_timeout_s: float = field(default=10.0, metadata=_help(
        "close a HTTP connection whose peer has taken nothing of the answers waiting for it for this long (the "
        "socket's buffers full: a peer that sends requests and reads no answer); a peer that reads steadily is "
        "not cut, however long the answer takes"))
    http_min_send_bytes_per_s: ByteCount = field(default=ByteCount(64 << 10), metadata={"metavar": "BYTES", "help": (
        "close a HTTP connection whose peer, --http-send-timeout-s into a wait for it to take the answers, has taken "
        "less than this many bytes per second of the wait (a peer that reads a byte now and then): an answer of N "
        "bytes is waited for at most --http-send-timeout-s + N / this")})
    # Only POST /v1/completions reads a body: its prompts, at most a batch of ids written as JSON.
    http_max_body_bytes: int = field(default=0, metadata=_help(
        "largest HTTP request body accepted (413 beyond; 0: what POST /v1/completions needs for "
        "--max-batch-tokens ids, 8 bytes each, plus 64 KiB)"))
    max_logprobs: int = field(default=256, metadata=_help(
        "largest `logprobs` and `prompt_logprobs` POST /v1/completions serves (vLLM's --max-logprobs, 20 "
        "there): each is a JSON entry per position, most of a response's size and time"))
    api_chunk_tokens: int = field(default=256, metadata=_help(
        "POST /v1/completions runs in forwards of at most this many tokens, each a forward of its own: a request's "
        "prompts grouped up to it, a longer prompt a chunk at a time on the model's KV cache (on one process; under "
        "tensor parallelism it runs whole). Another job's batch then waits for one such forward at most, not a whole "
        "request (0: up to --max-batch-tokens, a prompt whole)"))
    # teacher_server/openai/budget.py: each request is charged an upper bound of its answer's bytes.
    api_max_answer_bytes: ByteCount = field(default=0, metadata={"metavar": "BYTES", "help": (
        "host memory POST /v1/completions requests in flight may hold for their answers (the distributions kept "
        "to sample from, the JSON of their logprobs), each charged an upper bound from its parameters before its "
        "first forward: a request that does not fit beside others waits (503 after 300 s), one larger than this "
        "alone is refused (400) (0: a quarter of the host's available memory at start-up)")})
    # Part of every request's size bound (--max-request-bytes), which a caller can fill before its token is checked.
    max_score_ids: int = field(default=8, metadata=_help(
        "most ids per position a session may have scored (OutputSpec.score_ids): each request carries up to "
        "--max-batch-tokens x this many int32 ids"))
    # Part of the Join's size bound (--max-request-bytes): up to 12 bytes of pieces an entry, plus their lengths.
    max_student_vocab: int = field(default=0, metadata=_help(
        "most entries of a student vocabulary a cross-tokenizer session may send at join "
        "(JoinRequest.student_vocabulary; 0: the teacher's vocabulary size)"))
    max_weight: float = field(default=100.0, metadata=_help(
        "largest weight a job may ask for at join (its share of forwards against other jobs)"))
    max_sessions_per_job: int = field(default=0, metadata=_help(
        "sessions one job id may hold at once (0: only --max-sessions bounds them)"))
    job_tokens: str = field(default="", metadata={"metavar": "FILE", "help": (
        "JSON file of per-job tokens: {\"JOB_ID\": {\"token\": ..., \"max_weight\": ..., \"max_sessions\": ...}}; "
        "a caller with one may join only as its job and sees only its job's sessions (needs --auth-token, "
        "the operator's)")})
    # Read from --job-tokens at start-up; not a flag.
    job_token_entries: tuple = field(default=(), init=False, repr=False)
    # Bounds on what one session's outputs may cost the teacher per batch, checked at join: the
    # tensors derived for a batch live in teacher memory until the student has them.
    max_topk: int = field(default=1024, metadata=_help(
        "largest top-k a session may ask for (0: the vocabulary size); top-k of the whole vocabulary costs "
        "more than the logits themselves"))
    max_output_bytes: ByteCount = field(default=0, metadata={"metavar": "BYTES", "help": (
        "largest size of the outputs one session asks for its largest batch, plus what it is sent once at join "
        "(the output head), e.g. 2GiB (0: what full logits, top-k of --max-topk, every hidden state and the "
        "log-probability outputs of --max-batch-tokens tokens take in float32)")})
    # Outputs wait in teacher memory until their student receives them: a session that stops
    # receiving must not make the teacher hold more than its share of this.
    max_held_bytes: ByteCount = field(default=0, metadata={"metavar": "BYTES", "help": (
        "outputs computed and not yet received that the teacher holds, all sessions together, e.g. 8GiB; each "
        "job holds at most its share by weight, its sessions that reach it are not scheduled until their students "
        "receive, and beyond it one batch per job that holds nothing, so that every job is served "
        "(0: --max-inflight batches of the largest outputs --max-output-bytes allows, at most a quarter of the "
        "memory available on --device once the model is loaded)")})

    def __post_init__(self) -> None:
        check_choices(self)
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"--device {self.device!r}: use cpu, cuda or cuda:N")
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{flag(name)} {value} is not a TCP port (0..65535)")
        if self.port and self.port == self.http_port:  # 0 = any free port
            raise ConfigError(f"--port and --http-port must differ, got {self.port} for both")
        if self.max_seq_len < 0:
            raise ConfigError(f"--max-seq-len {self.max_seq_len} must be >= 1 (or 0: the model's limit)")
        if self.max_seq_len and self.max_batch_tokens < self.max_seq_len:
            raise ConfigError(f"--max-batch-tokens ({self.max_batch_tokens}) must be >= --max-seq-len "
                              f"({self.max_seq_len}): otherwise a single full-length sequence could never be served")
        if self.max_student_vocab < 0:
            raise ConfigError(f"--max-student-vocab {self.max_student_vocab} must be >= 0 (0: the teacher's "
                              "vocabulary size)")
        if self.max_score_ids < 0:
            raise ConfigError(f"--max-score-ids {self.max_score_ids} must be >= 0 (0: no ids scored)")
        if self.max_sessions < 1 or self.max_inflight < 1:
            raise ConfigError("--max-sessions and --max-inflight must be >= 1")
        if self.cache_bytes < 0:
            raise ConfigError(f"--cache-bytes {self.cache_bytes} must be >= 0 (0 turns the output cache off)")
        if self.cuda_graphs < 0:
            raise ConfigError(f"--cuda-graphs {self.cuda_graphs} must be >= 0 (0 turns CUDA graphs off)")
        self.fp8_keep_layer_list  # parses, or names the flag
        if not self.quantize and (self.fp8_keep_layers or self.fp8_scaling != "row" or self.fp8_fast_accum):
            raise ConfigError("--fp8-scaling, --fp8-keep-layers and --fp8-fast-accum set how --quantize fp8 "
                              "quantizes: add --quantize fp8")
        if not self.quantize and (self.fp8_calibration or self.fp8_max_kl or self.fp8_calibration_rows != 4
                                  or self.fp8_calibration_seq != 256 or self.fp8_bias_correction != "on"):
            raise ConfigError("--fp8-calibration, --fp8-calibration-rows, --fp8-calibration-seq, --fp8-max-kl and "
                              "--fp8-bias-correction set how --quantize fp8 measures itself: add --quantize fp8")
        if self.fp8_calibration_rows < 0 or self.fp8_calibration_seq < 1:
            raise ConfigError("--fp8-calibration-rows must be >= 0 (0: not measured) and --fp8-calibration-seq >= 1")
        if not 0 <= self.fp8_max_kl < math.inf:
            raise ConfigError(f"--fp8-max-kl {self.fp8_max_kl} must be a finite number >= 0 (nats per token; 0: no "
                              "bound)")
        if self.fp8_max_kl and not self.fp8_calibration_rows:
            raise ConfigError("--fp8-max-kl bounds the KL measured on the calibration batch: give "
                              "--fp8-calibration-rows above 0")
        if self.fp8_calibration and not os.path.isfile(self.fp8_calibration):
            raise ConfigError(f"--fp8-calibration {self.fp8_calibration}: no such file (give a UTF-8 text file, or "
                              "leave the flag out for the built-in sample)")
        if self.fp8_fast_accum and self.fp8_scaling != "row":
            raise ConfigError("--fp8-fast-accum is for --fp8-scaling row: block-scaled products accumulate in "
                              "float32; leave one of the two out")
        if self.lease_s <= self.heartbeat_interval_s:
            raise ConfigError(f"--lease-s ({self.lease_s}) must exceed --heartbeat-interval-s "
                              f"({self.heartbeat_interval_s})")
        for name in ("transfer_timeout_s", "join_timeout_s", "grace_period_s", "tp_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag(name)} must be > 0")
        if self.max_request_bytes and self.max_request_bytes < self.full_batch_bytes:
            raise ConfigError(f"--max-request-bytes {self.max_request_bytes} is too small for a batch of "
                              f"--max-batch-tokens {self.max_batch_tokens} (int64 ids and mask, int32 score ids): "
                              f"use at least "
                              f"{self.full_batch_bytes} (or 0 for that)")
        for name in ("max_request_bytes", "max_streams", "max_rpcs", "max_job_rpcs", "grpc_max_connections",
                     "max_held_bytes", "api_max_answer_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} {getattr(self, name)} must be >= 0 (0: derived from the other limits)")
        if self.http_max_connections < 1:
            raise ConfigError(f"--http-max-connections {self.http_max_connections} must be >= 1")
        for name in ("http_header_timeout_s", "http_send_timeout_s", "request_timeout_s", "grpc_idle_timeout_s",
                     "http_min_send_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{flag(name)} {getattr(self, name)} must be > 0")
        if self.http_max_body_bytes < 0 or self.grpc_max_streams_per_connection < 1:
            raise ConfigError("--http-max-body-bytes must be >= 0 and --grpc-max-streams-per-connection >= 1")
        if self.api_chunk_tokens < 0:
            raise ConfigError(f"--api-chunk-tokens {self.api_chunk_tokens} must be >= 0 (0: up to --max-batch-tokens)")
        if self.max_logprobs < 0:
            raise ConfigError(f"--max-logprobs {self.max_logprobs} must be >= 0")
        if self.max_topk < 0:
            raise ConfigError(f"--max-topk {self.max_topk} must be >= 0 (0: up to the vocabulary size)")
        if self.max_output_bytes < 0:
            raise ConfigError(f"--max-output-bytes {self.max_output_bytes} must be >= 0 (0: derived from the model)")
        if not 1 <= self.max_weight < float("inf"):
            raise ConfigError(f"--max-weight {self.max_weight} must be a finite number >= 1 (the default job weight)")
        if self.max_sessions_per_job < 0:
            raise ConfigError(f"--max-sessions-per-job {self.max_sessions_per_job} must be >= 0 (0: no cap per job)")
        if self.job_tokens:
            if not self.auth_token:
                raise ConfigError("--job-tokens needs --auth-token (or TEACHER_AUTH_TOKEN): the operator's token, "
                                  "which every caller without a job token must present")
            self.job_token_entries = read_job_tokens(self.job_tokens, self.auth_token)
        self._check_tls()

    @property
    def fp8_keep_layer_list(self) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in self.fp8_keep_layers.split(",") if part.strip())
        except ValueError as e:
            raise ConfigError(f"--fp8-keep-layers {self.fp8_keep_layers!r}: give decoder layer numbers separated "
                              "by commas, e.g. 0,-1") from e

    def fp8_plan(self):
        """--quantize fp8's plan for the model runner (None: no quantization at load)."""
        from teacher_server.fp8 import Fp8Plan

        return (Fp8Plan(self.fp8_scaling, self.fp8_keep_layer_list, self.fp8_compile, self.fp8_fast_accum,
                        calibration=self.fp8_calibration, calibration_rows=self.fp8_calibration_rows,
                        calibration_seq=self.fp8_calibration_seq, max_kl=self.fp8_max_kl,
                        bias_correction=self.fp8_bias_correction == "on")
                if self.quantize else None)

    def _check_tls(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: give both (PEM certificate chain and its key) "
                              "or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key: client certificates only exist over "
                              "TLS")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if getattr(self, name):
                read_pem(getattr(self, name), flag(name))
        if self.tls_cert:
            try:  # a key that does not belong to the certificate is caught here, not at the first handshake
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.tls_cert, self.tls_key)
            except ssl.SSLError as e:
                raise ConfigError(f"--tls-cert {self.tls_cert} and --tls-key {self.tls_key} do not form a usable "
                                  f"certificate and key pair: {e}") from e

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def api_answer_limit(self, host_available_bytes: int) -> int:
        """--api-max-answer-bytes, or HELD_MEMORY_SHARE of the host's available memory."""
        return self.api_max_answer_bytes or int(HELD_MEMORY_SHARE * host_available_bytes)

    @property
    def http_body_limit(self) -> int:
        """--http-max-body-bytes, or what a completions request of --max-batch-tokens ids needs."""
        return self.http_max_body_bytes or 8 * self.max_batch_tokens + (64 << 10)


# ---- --job-tokens -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobToken:
    """One entry of --job-tokens: a token that may join only as `job_id`, within its limits."""

    job_id: str
    token: str = field(repr=False)
    max_weight: float | None = None  # None: --max-weight
    max_sessions: int | None = None  # None: --max-sessions-per-job


_JOB_TOKEN_KEYS = {"token", "max_weight", "max_sessions"}
MIN_TOKEN_CHARS = 16


def read_job_tokens(path: str, auth_token: str) -> tuple[JobToken, ...]:
    """Reads --job-tokens: a JSON object keyed by job id (so that a message can name an entry
    without showing its token), each value {"token": ..., "max_weight": ..., "max_sessions": ...}.

    Raises ConfigError naming the flag, the file and the line (a syntax error) or the job and
    key (a bad value); never the token itself.
    """
    where = f"--job-tokens {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from e

    def unique_keys(pairs: list) -> dict:
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{where}: key {key!r} appears twice in one object; give each job one entry")
            seen[key] = value
        return seen

    try:
        table = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
    if not isinstance(table, dict) or not table:
        raise ConfigError(f'{where}: expected an object of jobs, e.g. {{"team-a": {{"token": "...", '
                          '"max_weight": 4, "max_sessions": 8}}}}')
    entries, tokens = [], set()
    for job_id, entry in table.items():
        at = f"{where}: job {job_id!r}"
        if not job_id or len(job_id) > 128:
            raise ConfigError(f"{at}: a job id has 1 to 128 characters")
        if not isinstance(entry, dict):
            raise ConfigError(f'{at}: expected an object such as {{"token": "...", "max_weight": 4, '
                              '"max_sessions": 8}}')
        unknown = sorted(set(entry) - _JOB_TOKEN_KEYS)
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r} (the keys are {', '.join(sorted(_JOB_TOKEN_KEYS))})")
        token = entry.get("token")
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or token != token.strip():
            raise ConfigError(f"{at}: key 'token' must be a string of at least {MIN_TOKEN_CHARS} characters "
                              "without surrounding spaces (e.g. python -c 'import secrets; "
                              "print(secrets.token_urlsafe(32))')")
        if token == auth_token:
            raise ConfigError(f"{at}: key 'token' is the operator's --auth-token; give each job a token of its own")
        if token in tokens:
            raise ConfigError(f"{at}: key 'token' is also another job's token; give each job a token of its own")
        tokens.add(token)
        max_weight = entry.get("max_weight")
        if max_weight is not None and (isinstance(max_weight, bool) or not isinstance(max_weight, (int, float))
                                       or not 1 <= max_weight < math.inf):
            raise ConfigError(f"{at}: key 'max_weight' must be a finite number >= 1, got {max_weight!r}")
        max_sessions = entry.get("max_sessions")
        if max_sessions is not None and (isinstance(max_sessions, bool) or not isinstance(max_sessions, int)
                                         or max_sessions < 1):
            raise ConfigError(f"{at}: key 'max_sessions' must be an integer >= 1, got {max_sessions!r}")
        entries.append(JobToken(job_id, token, None if max_weight is None else float(max_weight), max_sessions))
    return tuple(entries)
