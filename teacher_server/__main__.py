"""`python -m teacher_server` / `teacher-server`: parse, build, run, close."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from teacher_server.config import ServerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teacher-server", description="Serve a frozen teacher model to students.")
    ServerConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
