"""`python -m distill_demo` (`make demo`): parse, run, report. The last line printed is the RESULT line."""

from __future__ import annotations

import argparse
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distill_demo",
        description="Train a small teacher on the Python stdlib, serve it, and distil two students from it at "
                    "once; compare them with the same students trained without a teacher. CPU only, no downloads.")
    from distill_demo.config import DemoConfig

    DemoConfig.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = DemoConfig.from_args(args)
    except ValueError as e:
        parser.error(str(e))

    from distill_demo.demo import run_demo
    from distill_demo.processes import DemoError

    # SIGTERM unwinds like Ctrl-C, so the teacher server and trainers started so far are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_demo(config)
    except DemoError as e:
        print(f"\ndistill_demo failed: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\ndistill_demo interrupted; the teacher server and trainers it started are stopped",
              file=sys.stderr, flush=True)
        return 130
    print(result.result_line(), flush=True)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
