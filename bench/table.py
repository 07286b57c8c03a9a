"""How every bench ends: its table printed, and written to --out when given."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str = "") -> None:
    table = "\n".join(lines)
    print(table)
    if out:
        Path(out).write_text(table + "\n")
