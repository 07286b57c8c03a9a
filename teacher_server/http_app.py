"""The HTTP side: liveness, readiness, Prometheus metrics, a JSON status, and the part of
vLLM's OpenAI API that trainers ask a teacher for log-probabilities with (teacher_server/openai/).

With --auth-token, everything but the probes' /healthz and /readyz needs
`Authorization: Bearer <token>`: /metrics and /v1/status name jobs and sessions, and
/openapi.json describes the rest.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from fastapi import FastAPI, Header, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from distill_common import wire
from teacher_server.edge import bearer_matches
from teacher_server.engine import Engine
from teacher_server.metrics import Metrics
from teacher_server.openai.routes import add_routes


def create_app(engine: Engine, metrics: Metrics, ready: Callable[[], bool], auth_token: str = "",
               completions=None, callers=None) -> FastAPI:
    app = FastAPI(title="teacher-server", docs_url=None, redoc_url=None, openapi_url=None)
    info = engine.runner.info

    def refused(authorization: str | None) -> JSONResponse | None:
        if bearer_matches(authorization, auth_token):
            return None
        return JSONResponse({"error": "missing or wrong auth token (Authorization: Bearer <token>)"}, status_code=401)

    # The probes' endpoints run on the event loop, not in the thread pool that the others
    # share, so a burst of slow requests cannot delay them.
    @app.get("/healthz")
    async def healthz():
        # Alive: the process answers and the engine thread has not died.
        if not engine.healthy:
            return JSONResponse({"status": "engine failed", "error": repr(engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if not ready():
            return JSONResponse({"status": "not ready"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    def prometheus_metrics(authorization: str | None = Header(default=None)):
        if (refusal := refused(authorization)) is not None:
            return refusal
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(authorization: str | None = Header(default=None)):
        if (refusal := refused(authorization)) is not None:
            return refusal
        return JSONResponse(app.openapi())

    @app.get("/v1/status")
    def status(authorization: str | None = Header(default=None)):
        if (refusal := refused(authorization)) is not None:
            return refusal
        now = time.monotonic()
        return {
            "model": info.model_name,
            "architecture": info.architecture,
            "dtype": wire.dtype_name(info.dtype),
            # The decoder's linears in FP8 (--quantize fp8, or an FP8 checkpoint): format, scaling, source.
            "quantization": dataclasses.asdict(info.quantization),
            "devices": [str(info.device)],
            "tp_size": info.tp_size,
            "vocab_size": info.vocab_size,
            "hidden_size": info.hidden_size,
            "num_layers": info.num_layers,
            # The teacher's own kernels the model runs through (MoE experts, attention sinks).
            "kernels": info.kernels,
            # An MoE teacher's tokens per expert per layer and their imbalance (null for a dense one).
            "experts": (engine.runner.expert_load.snapshot().status()
                        if engine.runner.expert_load is not None else None),
            # What sessions that apply the head themselves, or ask for attention inputs, get; or why not.
            "output_head": dataclasses.asdict(info.head),
            "attention_inputs": dataclasses.asdict(info.attention),
            "ready": ready(),
            "queue_depth": engine.queue_depth(),
            # Outputs computed and not yet received, and their bound (--max-held-bytes).
            "held_bytes": engine.held_bytes(), "held_bytes_limit": engine.scheduler.held_bytes_limit,
            "busy_fraction": metrics.busy_clock.fraction(),
            # Shared work: hits/misses/evictions of the output cache (--cache-bytes), batches
            # served by an identical batch of the same forward, bytes held on the device.
            "cache": dataclasses.asdict(engine.cache.stats()),
            # --cuda-graphs: pack shapes captured, the cap, and why graphs are off if they are.
            "cuda_graphs": engine.runner.graphs.status() if engine.runner.graphs is not None else None,
            "sessions": [{
                "session_id": s.session_id, "job_id": s.job_id, "job_rank": s.job_rank, "backend": s.backend,
                "state": s.state, "batches_submitted": s.batches_submitted, "batches_sent": s.batches_sent,
                "tokens_served": s.tokens_served, "bytes_sent": s.bytes_sent, "inflight": s.inflight,
                "weight": s.weight, "last_heartbeat_age_s": round(now - s.last_heartbeat, 3),
            } for s in engine.sessions()],
        }

    if completions is not None:  # vLLM's OpenAI API: GET /v1/models, GET /health, POST /v1/completions
        add_routes(app, completions, callers, ready)
    return app
