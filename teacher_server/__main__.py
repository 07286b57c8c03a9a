"""`python -m teacher_server` / `teacher-server`: parse, build, run, close."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn

# Packed forwards change size from one to the next and their outputs live on until the
# students have them; expandable segments grow the allocator's pool in place instead of
# a cudaMalloc (and, when fragmented, a device-wide cudaFree) per new size. Read when
# CUDA initialises, so set before torch touches it; a user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from distill_common.settings import ConfigError, non_defaults, settings_from, settings_parser
from teacher_server.config import ServerConfig
from teacher_server.logs import setup_logging

log = logging.getLogger("teacher_server")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("status", "info"):
        return _admin(argv[0], argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = settings_parser(
        ServerConfig, prog="teacher-server", description="Serve a frozen teacher model to students. Other commands: "
        "`teacher-server status HOST:PORT` (the sessions), `teacher-server info HOST:PORT` (model and limits).")
    args = parser.parse_args(argv)
    try:
        config = settings_from(ServerConfig, args)
    except ConfigError as e:
        parser.error(str(e))
    setup_logging(config.log_level, config.log_format)
    log.info("teacher server settings (non-default): %s", non_defaults(config) or "none")

    from distill_common.models import model_config, position_limit  # heavy imports after argument errors
    from teacher_server import parallel
    from teacher_server.model_runner import ModelRunner

    # Settings the model cannot run are refused before its weights load (on every rank alike).
    try:
        model = model_config(config.model, config.trust_remote_code)
        text = model.get_text_config() if hasattr(model, "get_text_config") else model
        config.fit_model(position_limit(model, config.trust_remote_code), getattr(text, "vocab_size", 0) or 0)
    except ConfigError as e:
        parser.error(f"--model {config.model}: {e}")
    except ValueError as e:
        parser.error(f"--model: {e}")
    if not args.max_seq_len:
        log.info("--max-seq-len %d; the model's limit: %s", config.max_seq_len,
                 config.position_limit or "none (its positions have no table)")

    # Under torchrun with several ranks: rank 0 serves, the others follow (teacher_server/parallel.py).
    world = None
    if parallel.world_size_from_env() > 1:
        try:  # a bad size is refused before any rank joins the world: each rank says why and exits
            parallel.check_heads(model, parallel.world_size_from_env())
            world = parallel.init_world(config.device, config.tp_timeout_s)
        except ValueError as e:
            parser.error(f"--model {config.model}: {e}")
        if not world.leader:
            return _follow(world, config)
        # A broken world (a rank died or hung) stops the server as SIGTERM would: /readyz
        # turns 503, sessions end with the reason, and the exit status says it failed.
        world.on_broken = lambda: os.kill(os.getpid(), signal.SIGTERM)

    from teacher_server.app import TeacherServer

    try:
        runner = ModelRunner(config.model, config.device, config.dtype, config.trust_remote_code, world=world,
                             cuda_graphs=config.cuda_graphs, quantize=config.fp8_plan())
    except ValueError as e:  # a model that cannot be loaded, settings that do not fit it: say which flag
        parser.error(str(e))
    try:
        asyncio.run(TeacherServer(config, runner).serve())
    finally:
        runner.close()  # tells the other ranks to stop
    if not runner.healthy:
        # A broken world may leave collectives that never finish (the engine thread waiting on
        # one); a normal interpreter exit could wait on them forever.
        _exit_now(1)
    if world is not None:
        _exit_now(0)
    return 0


def _admin(command: str, argv: list[str]) -> int:
    """`teacher-server status|info HOST:PORT [options]`: 1 when the teacher cannot be asked."""
    from teacher_server.admin import AdminConfig, AdminError, query

    parser = settings_parser(AdminConfig, prog=f"teacher-server {command}", usage="%(prog)s HOST:PORT [options]",
                             description=f"Print the {command} of a running teacher server.")
    parser.add_argument("address", help="the teacher's gRPC address, HOST:PORT; or a pool's (a comma list, "
                                        "dns:NAME:PORT, file:PATH): each replica's, one after another")
    args = parser.parse_args(argv)
    try:
        config = settings_from(AdminConfig, args)
    except ConfigError as e:
        parser.error(str(e))
    try:
        print(query(command, args.address, config))
    except AdminError as e:
        print(f"teacher-server {command}: {e}", file=sys.stderr)
        return 1
    return 0


def _exit_now(code: int) -> NoReturn:
    """Exits a tensor-parallel rank without interpreter finalization.

    The sharded model keeps references to the TP world's process groups; destroyed while
    the interpreter shuts down, their C++ destructors can meet threads still joinable and
    abort the process ("terminate called without an active exception", exit -6) after a
    clean stop. Everything that matters is done by now: logs flushed, groups destroyed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _follow(world, config: ServerConfig) -> NoReturn:
    """A rank other than 0: its shard of the model, the forwards rank 0 asks for, until stop."""
    from teacher_server.model_runner import ModelRunner
    from teacher_server.parallel import TensorParallelError

    # torchrun passes SIGTERM/SIGINT to every rank; rank 0 drains its batches in flight, which
    # needs this rank's part of each forward, and then says stop. A dead rank 0 ends the wait
    # anyway (--tp-timeout-s), and torchrun kills what is left after its shutdown timeout.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: log.info("rank %d: %s; waiting for rank 0 to say stop", world.rank,
                                                          signal.Signals(signum).name))
    try:  # settings rank 0 refuses are refused here too, or this rank would wait for it in vain
        runner = ModelRunner(config.model, config.device, config.dtype, config.trust_remote_code, world=world,
                             cuda_graphs=config.cuda_graphs, quantize=config.fp8_plan())
    except ValueError as e:
        log.error("rank %d: %s", world.rank, e)
        _exit_now(2)
    try:
        runner.follow()
    except TensorParallelError as e:
        log.error("%s", e)
        _exit_now(1)
    runner.close()
    log.info("tensor-parallel rank %d stopped", world.rank)
    _exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
