"""Whether a `--quantize fp8` teacher's decoder captures into CUDA graphs, for each way its FP8
layers are compiled (one GPU, seconds).

    python3 -m bench.investigations.fp8_cuda_graphs

For each `--fp8-compile` mode (layers, quantize, off): a tiny bf16 Llama quantized at load, served
by a ModelRunner with `--cuda-graphs 2`, four forwards of one shape (the first runs eagerly, the
second captures, the others replay), against the same model without graphs. Prints, per mode,
whether the shape was captured (or why not, with the whole error and dynamo's recompilation
reasons), whether the replays equal each other, and how far they are from the forward without
graphs.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from teacher_server import fp8
from teacher_server.model_runner import ModelRunner
from tests.helpers import build_tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="layers,quantize,off")
    parser.add_argument("--shape", default="2x32")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("teacher_server.cuda_graphs").setLevel(logging.DEBUG)  # the capture's error, whole
    torch._logging.set_logs(recompiles=True)
    rows, seq = (int(n) for n in args.shape.split("x"))
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="fp8-graphs-")) / "bf16", vocab_size=384,
                                 hidden_size=256, dtype=torch.bfloat16)
    ids = torch.randint(0, 384, (rows, seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    lines = ["| --fp8-compile | captured | replays equal | replay equals the eager first | replay vs no graphs (rel) | why not |",
             "|---|---|---|---|---:|---|"]
    for mode in args.modes.split(","):
        plan = fp8.Fp8Plan("row", compile=mode)
        plain = ModelRunner(str(model_dir), "cuda:0", quantize=plan)
        graphed = ModelRunner(str(model_dir), "cuda:0", quantize=plan, cuda_graphs=2)
        want = plain.forward(ids, mask).logits.float()
        outs = [graphed.forward(ids, mask).logits.float() for _ in range(4)]
        equal = all(torch.equal(outs[1], out) for out in outs[2:])
        rel = ((outs[-1] - want).norm() / want.norm()).item()
        lines.append(f"| {mode} | {bool(graphed.graphs.captured)} | {equal} | {torch.equal(outs[0], outs[-1])} | "
                     f"{rel:.2e} | {graphed.graphs.off} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
