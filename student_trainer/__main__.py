"""`python -m student_trainer train ...` / `student-trainer train ...`: parse, build, run."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Receive buffers of full logits come and go every step: see teacher_server/__main__.py.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    from distill_common.settings import ConfigError, parser_options, settings_from
    from student_trainer.config import TrainConfig

    parser = argparse.ArgumentParser(prog="student-trainer", description="Distil a student from a teacher server.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    train_parser = commands.add_parser(
        "train", dataclass_types=TrainConfig, help="train a student against a running teacher server",
        **parser_options(usage="%(prog)s --model MODEL --data DATA [options]",
                         description="Train a student against a running teacher server (or with plain "
                                     "cross-entropy: --kd-weight 0)."))
    args = parser.parse_args(argv)
    try:
        config = settings_from(TrainConfig, args)
    except ConfigError as e:
        train_parser.error(str(e))
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=config.log_level.upper() if rank == 0 else "WARNING",
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")

    from student_trainer.data import DataError
    from student_trainer.errors import TeacherError
    from student_trainer.train import train

    try:
        result = train(config)
    except (ConfigError, DataError, TeacherError) as e:
        # The message says what to change; a traceback would only bury it.
        logging.getLogger("student_trainer").error("%s: %s", type(e).__name__, e)
        return 1
    if rank == 0 and result["history"]:
        last = result["history"][-1]
        print(f"trained to step {result['step']}: loss {last['loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
