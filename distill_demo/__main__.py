"""`python -m distill_demo` (`make demo`): parse, run, report. The last line printed is the RESULT line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from distill_demo.config import QUICK, DemoConfig, parse_settings

    config = parse_settings(
        DemoConfig, argv, "python -m distill_demo",
        "Train a small teacher on the Python stdlib, serve it, and distil two students from it at once; compare "
        "them with the same students trained without a teacher. CPU only, no downloads.", quick=QUICK)

    from distill_demo.demo import run_demo
    from distill_demo.processes import run_command

    return run_command("distill_demo", lambda: run_demo(config))


if __name__ == "__main__":
    sys.exit(main())
