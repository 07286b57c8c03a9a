"""What a grpc.aio server pays per streamed message, answered or not (no GPU, no model).

    python -m bench.investigations.grpc_stream_cost --messages 20000

A grpc.aio server process with one stream-stream method (raw bytes, as the teacher's
handlers take them) and a client streaming --messages messages of 8 KiB (the ids of a
1,046-token batch as int64). The server answers every message, every 8th, or none; the
table gives messages per second and the server process's CPU time per message (all
threads, from /proc). Why JoinRequest.stream_refusals_only exists. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import grpc

from bench.investigations.serving_cost import thread_cpu_s
from bench.table import emit

MODES = {"every message": 1, "every 8th": 8, "none": 0}


def serve(port: int, every: int, ready) -> None:
    async def stream(requests, context):
        count = 0
        async for _ in requests:
            count += 1
            if every and count % every == 0:
                yield b"ok"
        yield b"end"

    async def main():
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Stream", {"Stream": grpc.stream_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def measure(every: int, messages: int, port: int) -> tuple[float, float]:
    ready = mp.Event()
    proc = mp.Process(target=serve, args=(port, every, ready), daemon=True)
    proc.start()
    if not ready.wait(30):
        raise RuntimeError("the bench server did not start within 30 s")
    payload = b"x" * 8368
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/bench.Stream/Stream")
            before, start = sum(thread_cpu_s(proc.pid).values()), time.perf_counter()
            for _ in call((payload for _ in range(messages)), timeout=300):
                pass
            wall, after = time.perf_counter() - start, sum(thread_cpu_s(proc.pid).values())
    finally:
        proc.terminate()
        proc.join(10)
    return messages / wall, (after - before) / messages * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--port", type=int, default=50611)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    for i, (name, every) in enumerate(MODES.items()):
        rate, cpu_us = measure(every, args.messages, args.port + i)
        rows.append(f"| {name} | {rate:,.0f} | {cpu_us:.0f} |")
    emit([f"grpc.aio stream, {args.messages} messages of 8 KiB, grpcio {grpc.__version__}", "",
          "| server answers | messages/s | server CPU µs per message |", "|---|---:|---:|", *rows], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
