"""`python -m student_trainer train|dump|eagle3|eagle3-eval ...` (`student-trainer ...`): parse, build, run."""

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
    from student_trainer.config import DumpConfig, TrainConfig
    from student_trainer.eagle3.config import Eagle3Config, Eagle3EvalConfig

    parser = argparse.ArgumentParser(prog="student-trainer", description="Distil a student from a teacher server.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=HfArgumentParser)
    train_parser = commands.add_parser(
        "train", dataclass_types=TrainConfig, help="train a student against a running teacher server",
        **parser_options(usage="%(prog)s --model MODEL --data DATA [options]",
                         description="Train a student against a running teacher server (or with plain "
                                     "cross-entropy: --kd-weight 0)."))
    dump_parser = commands.add_parser(
        "dump", dataclass_types=DumpConfig, help="compute the teacher's outputs once, into a store train reads",
        **parser_options(usage="%(prog)s (--teacher HOST:PORT --tokenizer DIR | --model DIR) --data DATA "
                               "--teacher-outputs DIR (--topk K | --logits | ...) [options]",
                         description="Write the teacher's outputs for every example of --data (tokenized and packed "
                                     "as train does) into a store: safetensors shards and a manifest "
                                     "(docs/training.md#teacher-outputs-computed-once). train --teacher-outputs DIR "
                                     "reads it; a dump killed and started again continues."))
    eagle3_parser = commands.add_parser(
        "eagle3", dataclass_types=Eagle3Config, help="train an EAGLE-3 draft for the teacher's model",
        **parser_options(usage="%(prog)s --teacher HOST:PORT --target-model DIR --data DATA [options]",
                         description="Train an EAGLE-3 speculative-decoding draft from a running teacher server "
                                     "(docs/eagle3.md); the draft is exported for vLLM and SGLang to "
                                     "OUTPUT_DIR/draft."))
    eval_parser = commands.add_parser(
        "eagle3-eval", dataclass_types=Eagle3EvalConfig, help="an EAGLE-3 draft's acceptance length",
        **parser_options(usage="%(prog)s --teacher HOST:PORT --draft DIR --data DATA [options]",
                         description="Decode held-out prompts greedily with the teacher, verifying the draft's "
                                     "proposals; print the acceptance rate per position and the mean acceptance "
                                     "length."))
    args = parser.parse_args(argv)
    settings, command_parser = {"train": (TrainConfig, train_parser), "dump": (DumpConfig, dump_parser),
                                "eagle3": (Eagle3Config, eagle3_parser),
                                "eagle3-eval": (Eagle3EvalConfig, eval_parser)}[args.command]
    try:
        config = settings_from(settings, args)
    except ConfigError as e:
        command_parser.error(str(e))
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=config.log_level.upper() if rank == 0 else "WARNING",
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")

    from student_trainer.data import DataError
    from student_trainer.errors import TeacherError
    from student_trainer.eagle3.model import DraftFormatError
    from distill_common.store import StoreError

    try:
        if args.command == "eagle3-eval":
            from student_trainer.eagle3.evaluate import evaluate_acceptance

            print(evaluate_acceptance(config).report(), flush=True)
            return 0
        if args.command == "dump":
            from student_trainer.store import dump

            result = dump(config)
            print(f"dumped {result.rows_written} rows ({result.tokens_written} tokens) in {result.shards_written} "
                  f"shards to {config.teacher_outputs}: it holds {result.rows} rows", flush=True)
            return 0
        if args.command == "eagle3":
            from student_trainer.eagle3.train import train_eagle3 as run
        else:
            from student_trainer.train import train as run
        result = run(config)
    except (ConfigError, DataError, TeacherError, DraftFormatError, StoreError) as e:
        # The message says what to change; a traceback would only bury it.
        logging.getLogger("student_trainer").error("%s: %s", type(e).__name__, e)
        return 1
    if rank == 0 and result["history"]:
        last = result["history"][-1]
        accuracies = " ".join(f"{last[key]:.3f}" for key in last if key.startswith("acc_"))
        print(f"trained to step {result['step']}: loss {last['loss']:.4f}"
              + (f", per-step accuracy {accuracies}" if accuracies else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
