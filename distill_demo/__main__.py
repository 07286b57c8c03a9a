"""`python -m distill_demo` (`make demo`): parse, run, report. The last line printed is the RESULT line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from distill_common.settings import ConfigError, settings_from, settings_parser
    from distill_demo.config import QUICK, DemoConfig

    parser = settings_parser(
        DemoConfig, prog="python -m distill_demo",
        description="Train a small teacher on the Python stdlib, serve it, and distil two students from it at "
                    "once; compare them with the same students trained without a teacher. CPU only, no downloads.")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # the preset's values, under the flags given explicitly
    args = parser.parse_args(argv)
    try:
        config = settings_from(DemoConfig, args)
    except ConfigError as e:
        parser.error(str(e))

    from distill_demo.demo import run_demo
    from distill_demo.processes import run_command

    return run_command("distill_demo", lambda: run_demo(config))


if __name__ == "__main__":
    sys.exit(main())
