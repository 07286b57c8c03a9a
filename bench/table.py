"""How every bench ends: its table printed, and written to --out when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(lines: list[str], out: str = "", figures=None) -> None:
    """`figures` (JSON-able): also written beside the table, as OUT with the suffix .json."""
    table = "\n".join(lines)
    print(table)
    if out:
        Path(out).write_text(table + "\n")
        if figures is not None:
            Path(out).with_suffix(".json").write_text(json.dumps(figures, indent=2) + "\n")
