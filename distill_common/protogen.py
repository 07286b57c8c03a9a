"""Regenerates the gRPC stubs from proto/ (``make proto``); ``--check`` fails when they are stale.

The stubs are committed so that the package imports without grpcio-tools. They are
generated with grpcio-tools 1.84 (requirements/ci.txt): stubs from a newer
grpcio-tools refuse to import on an older grpcio runtime, and the GPU image has 1.84.0.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILE = "teacher/v1/teacher.proto"
# The stubs import each other by this package path, so the proto is mapped into it.
PACKAGE_PATH = "distill_common/proto"
GENERATED = ("teacher_pb2.py", "teacher_pb2.pyi", "teacher_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc refused the proto; the message carries its command line (its own output is above)."""


def generate(out_root: Path) -> Path:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PACKAGE_PATH}={PROTO_DIR}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"{PACKAGE_PATH}/{PROTO_FILE}",
    ]
    # protoc resolves the virtual path itself; the file argument is the virtual name.
    rc = protoc.main(args)
    if rc != 0:
        raise ProtocError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    return out_root / PACKAGE_PATH / Path(PROTO_FILE).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args(argv)
    committed = ROOT / PACKAGE_PATH / Path(PROTO_FILE).parent
    try:
        if not args.check:
            generate(ROOT)
            print(f"regenerated {', '.join(GENERATED)} in {committed.relative_to(ROOT)}")
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp))
            stale = [name for name in GENERATED if not (committed / name).exists()
                     or not filecmp.cmp(fresh / name, committed / name, shallow=False)]
    except ProtocError as e:
        print(e, file=sys.stderr)
        return 1
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run `make proto` and commit", file=sys.stderr)
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
