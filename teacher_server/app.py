"""Builds the teacher server from its config and runs it until SIGTERM/SIGINT.

gRPC (grpc.aio) and HTTP (uvicorn) share one asyncio loop; the engine runs in its own
thread. The teacher listens on those two ports only: each session's group forms on a
store of its own in this process, which its student reaches through the gRPC service
(distill_common/rendezvous.py).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import socket
import sys

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from distill_common.channel import read_pem
from teacher_server import session_process
from teacher_server.config import ServerConfig
from teacher_server.edge import (RELEASE_INTERVAL_S, CallGuard, Callers, GuardedH11Protocol, HttpConnections,
                                 grpc_connections_limit, grpc_server_options, install_accept_error_log,
                                 raise_descriptor_limit, release_free_memory)
from teacher_server.engine import Engine
from teacher_server.http_app import create_app
from teacher_server.openai.jobs import ApiJobs
from teacher_server.openai.routes import Completions
from teacher_server.limits import HELD_MEMORY_SHARE, available_memory_bytes
from teacher_server.metrics import Metrics
from teacher_server.model_runner import ModelRunner
from teacher_server.service import SERVICE_NAME, TeacherService, generic_handler

log = logging.getLogger(__name__)


def advertised_host(config: ServerConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    if config.host not in ("0.0.0.0", "::", ""):
        return config.host
    return socket.gethostbyname(socket.gethostname())


def grpc_server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS for the gRPC port; with --tls-client-ca, clients must present a certificate it signed."""
    client_ca = read_pem(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    key_and_cert = (read_pem(config.tls_key, "--tls-key"), read_pem(config.tls_cert, "--tls-cert"))
    return grpc.ssl_server_credentials([key_and_cert], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class TeacherServer:
    def __init__(self, config: ServerConfig, runner: ModelRunner):
        """`runner`: the model runner, built by the caller (on rank 0 of a tensor-parallel world, its
        part of that world)."""
        # The engine thread runs Python for every kernel launch of the forward; with the
        # default 5 ms switch interval a gRPC handler or a sender thread waiting for the
        # GIL stalls up to 5 ms per handoff, which adds up to milliseconds per batch.
        sys.setswitchinterval(0.0005)
        self.config = config
        self.advertise_host = advertised_host(config)
        self.runner = runner
        self.metrics = Metrics(self.runner.device)
        self.engine = Engine(
            self.runner, self.metrics, advertise_host=self.advertise_host,
            max_batch_tokens=config.max_batch_tokens, max_sessions=config.max_sessions, lease_s=config.lease_s,
            join_timeout_s=config.join_timeout_s, transfer_timeout_s=config.transfer_timeout_s,
            cache_bytes=config.cache_bytes, isolate_sessions=config.session_transport == "process")
        if config.session_transport == "process":
            session_process.start()  # the first join does not wait for the fork server
        self.callers = Callers(config)  # the operator's token and the job tokens: who may do what
        self.service = TeacherService(self.engine, config, self.metrics, self.advertise_host, self.callers)
        # The budget of outputs held for students depends on what a batch's outputs can take,
        # which the service knows from the model.
        available_bytes = available_memory_bytes(config.device)
        held_limit_bytes = config.held_bytes_limit(self.service.facts, available_bytes)
        self.engine.scheduler.held_bytes_limit = held_limit_bytes
        if not config.max_held_bytes:
            log.info("--max-held-bytes %d (%.1f GiB): the lesser of --max-inflight %d batches of the largest outputs "
                     "(%.1f GiB) and %d%% of the %.1f GiB available on %s; set --max-held-bytes to choose",
                     held_limit_bytes, held_limit_bytes / 2**30, config.max_inflight,
                     config.max_inflight * config.output_bytes_limit(self.service.facts) / 2**30,
                     round(100 * HELD_MEMORY_SHARE), available_bytes / 2**30, config.device)
        # vLLM's OpenAI API (teacher_server/openai/): its requests are batches of in-process sessions.
        answer_limit_bytes = config.api_answer_limit(available_memory_bytes("cpu"))
        if not config.api_max_answer_bytes:
            log.info("--api-max-answer-bytes %d (%.1f GiB): %d%% of the host's available memory; set it to choose",
                     answer_limit_bytes, answer_limit_bytes / 2**30, round(100 * HELD_MEMORY_SHARE))
        self.api_jobs = ApiJobs(self.engine, max_inflight=config.max_inflight, timeout_s=config.transfer_timeout_s)
        self.completions = Completions(self.api_jobs, self.service.facts, getattr(runner, "tokenizer", None),
                                       model_id=config.model, max_seq_len=config.max_seq_len,
                                       max_batch_tokens=config.max_batch_tokens, max_logprobs=config.max_logprobs,
                                       answer_limit_bytes=answer_limit_bytes,
                                       chunk_tokens=config.api_chunk_tokens,
                                       chunked_prompts=getattr(runner, "world", None) is None)
        self.metrics.watch_answers(self.completions.budget)
        self.health = health.aio.HealthServicer()
        self._shutting_down = False
        self.grpc_port = 0
        self.http_port = 0

    def ready(self) -> bool:
        return not self._shutting_down and self.engine.accepting

    async def serve(self) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        self.engine.start()
        install_accept_error_log(loop)
        # Requests hold a batch of token ids at most (16 bytes a token: int64 ids and mask), so
        # the limit is what a full batch needs. grpc enforces it as a message arrives, before
        # any handler runs: the refusal is grpc's own RESOURCE_EXHAUSTED ("Received message
        # larger than max (N vs. LIMIT)"); docs/security.md names the flag. The CallGuard runs
        # first on every call, so a call without the token is refused before its request is read.
        descriptors = raise_descriptor_limit()
        releasing = asyncio.create_task(self._release_free_memory())
        self.grpc_max_connections = grpc_connections_limit(c, descriptors)
        server = grpc.aio.server(interceptors=[CallGuard(self.callers, c, self.metrics)],
                                 options=grpc_server_options(c, self.grpc_max_connections))
        server.add_generic_rpc_handlers((generic_handler(self.service, self.metrics),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if c.tls:
            self.grpc_port = server.add_secure_port(f"{c.host}:{c.port}", grpc_server_credentials(c))
        else:
            self.grpc_port = server.add_insecure_port(f"{c.host}:{c.port}")
        await server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

        # HTTPS without client certificates even under --tls-client-ca: kubelet probes and most
        # scrapers present none; /v1/status stays behind the token.
        # uvicorn's own limit_concurrency is left off: it counts open connections, idle ones too,
        # so sockets held open by anyone would make it answer 503 to every probe. The guarded
        # protocol caps connections instead, and one connection serves one request at a time.
        # asyncio accepts up to `backlog` connections in one pass of its loop, before any of them
        # is read. Kept well under the cap, a probe accepted in one pass has its request read in
        # the next before a flood's later connections can push it out as the oldest idle one;
        # and a flood holds at most cap + backlog descriptors.
        protocol = functools.partial(GuardedH11Protocol,
                                     connections=HttpConnections(c.http_max_connections, c.http_header_timeout_s,
                                                                 c.http_send_timeout_s, c.http_body_limit,
                                                                 c.http_min_send_bytes_per_s))
        http = uvicorn.Server(uvicorn.Config(create_app(self.engine, self.metrics, self.ready, c.auth_token, self.completions, self.callers), host=c.host,
                                             port=c.http_port, log_level="warning", lifespan="off", http=protocol,
                                             backlog=max(8, c.http_max_connections // 4),
                                             ssl_certfile=c.tls_cert or None, ssl_keyfile=c.tls_key or None))
        http.install_signal_handlers = lambda: None  # this loop handles signals (graceful shutdown)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        http_task = asyncio.create_task(http.serve())
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await http_task  # raises the bind error
            raise RuntimeError(f"the HTTP server on port {c.http_port} stopped at start-up")
        self.http_port = http.servers[0].sockets[0].getsockname()[1] if http.servers else c.http_port
        # Everything built so far (the model, transformers' modules) lives as long as the
        # process: freezing it keeps the cyclic GC from walking millions of objects every
        # few hundred batches, a pause of tens of ms in the engine thread each time.
        gc.collect()
        gc.freeze()
        log.info("teacher ready: gRPC%s %s:%d, HTTP%s :%d, data plane at %s, model %s, requests up to %d bytes "
                 "(--max-request-bytes), up to %d gRPC connections (descriptor limit %d)", " (TLS)" if c.tls else "",
                 c.host, self.grpc_port, "S" if c.tls else "", self.http_port, self.advertise_host, c.model,
                 c.request_limit_bytes, self.grpc_max_connections, descriptors)
        print(f"READY grpc={self.grpc_port} http={self.http_port}", flush=True)

        await stop.wait()
        releasing.cancel()
        await self._shutdown(server, http, http_task)

    async def _release_free_memory(self) -> None:
        """Every RELEASE_INTERVAL_S, the allocator's free pages back to the system (edge.release_free_memory)."""
        while await asyncio.to_thread(release_free_memory):
            await asyncio.sleep(RELEASE_INTERVAL_S)
        log.info("the allocator is not glibc's: freed requests go back to the system as it decides")

    async def _shutdown(self, server, http, http_task) -> None:
        """Graceful: refuse new sessions, finish batches in flight, then close."""
        log.info("shutting down: finishing batches in flight (grace %.0fs)", self.config.grace_period_s)
        self._shutting_down = True
        self.engine.stop_accepting()
        await self.health.enter_graceful_shutdown()
        drained = await asyncio.to_thread(self.engine.drain, self.config.grace_period_s)
        if not drained:
            log.warning("grace period over with batches still in flight; ending their sessions")
        await asyncio.to_thread(self.engine.stop)
        await server.stop(grace=1.0)
        self.service.joining.work.close()
        http.should_exit = True
        await http_task
        await self.completions.close()
        log.info("teacher stopped")
