"""`python -m teacher_server` / `teacher-server`: parse, build, run, close."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

# Packed forwards change size from one to the next and their outputs live on until the
# students have them; expandable segments grow the allocator's pool in place instead of
# a cudaMalloc (and, when fragmented, a device-wide cudaFree) per new size. Read when
# CUDA initialises, so set before torch touches it; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from teacher_server.config import ServerConfig
from teacher_server.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("status", "info"):
        from teacher_server.admin import main as admin_main

        return admin_main(argv[0], argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="teacher-server", description="Serve a frozen teacher model to students. Other commands: "
        "`teacher-server status HOST:PORT` (the sessions), `teacher-server info HOST:PORT` (model and limits).")
    ServerConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank would bind the same ports and serve its own copy of the model.
        parser.error("tensor parallelism across several processes is not implemented yet: start the teacher "
                     "as one process (torchrun --nproc-per-node 1, or plain python -m teacher_server)")
    try:
        config = ServerConfig.from_args(args)
    except ValueError as e:
        parser.error(str(e))
    config.log_non_defaults()

    from teacher_server.app import TeacherServer  # heavy imports after argument errors

    server = TeacherServer(config)
    asyncio.run(server.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
