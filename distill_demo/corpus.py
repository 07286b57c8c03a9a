"""A training corpus present on every machine: the Python standard library's own source.

No download, a few MB of real, varied text (code, docstrings, comments), and the same
files wherever the same Python version is installed. The split into train and
held-out is by *file*, so held-out loss is measured on files the student never saw,
not on other chunks of files it trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

# Directories left out: the test suites (large, repetitive, and some of their files
# are deliberately malformed), third-party packages, and bytecode caches.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Generated at build time with this machine's paths and compiler flags; it would make
# the corpus differ between machines that have the same Python version.
_EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)

TRAIN_FILENAME = "train.jsonl"
HELDOUT_FILENAME = "heldout.jsonl"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted by path relative to the stdlib root."""
    root = stdlib_root()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded directories.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(_EXCLUDED_FILE_PREFIXES):
                files.append(Path(dirpath) / name)
    files.sort(key=lambda path: path.relative_to(root).as_posix())
    if not files:
        raise FileNotFoundError(
            f"No .py files under the standard library directory {root}; this Python ships compiled "
            f"modules only. Run the demo with a Python that includes its library sources, or pass "
            f"your own JSONL corpus instead."
        )
    return files


def heldout_score(relative_path: str, seed: int) -> float:
    """A uniform-looking number in [0, 1) fixed by the file's relative path and the seed.

    A file is held out when its score is below the held-out fraction. A hash (not a
    shuffled list) means adding or removing other files never moves this one between
    train and held-out.
    """
    digest = hashlib.sha256(f"{seed}\x00{relative_path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_files(relative_paths: list[str], heldout_fraction: float, seed: int) -> set[str]:
    """The relative paths that go to the held-out split.

    When there are at least two files and 0 < heldout_fraction, each split gets at
    least one file (the lowest-scoring file is held out, the highest-scoring one is
    trained on), so a tiny `max_files` still yields a usable held-out set.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be in [0, 1); use e.g. 0.05.")
    scores = {path: heldout_score(path, seed) for path in relative_paths}
    heldout = {path for path, score in scores.items() if score < heldout_fraction}
    if heldout_fraction > 0 and len(relative_paths) >= 2:
        ranked = sorted(relative_paths, key=lambda path: (scores[path], path))
        heldout.add(ranked[0])
        heldout.discard(ranked[-1])
    return heldout


def chunk_text(text: str, seq_chars: int) -> list[str]:
    """Cuts text into chunks of at most seq_chars characters, at line ends where possible.

    Whole lines keep chunks readable and keep a line's tokens together; a single line
    longer than seq_chars is cut hard. Whitespace-only chunks are dropped.
    """
    chunks: list[str] = []
    current: list[str] = []
    current_chars = 0
    for line in text.splitlines(keepends=True):
        while len(line) > seq_chars:
            if current:
                chunks.append("".join(current))
                current, current_chars = [], 0
            chunks.append(line[:seq_chars])
            line = line[seq_chars:]
        if current_chars + len(line) > seq_chars:
            chunks.append("".join(current))
            current, current_chars = [], 0
        current.append(line)
        current_chars += len(line)
    if current:
        chunks.append("".join(current))
    return [chunk for chunk in chunks if chunk.strip()]


def write_jsonl_corpus(
    out_dir: str | Path,
    *,
    seq_chars: int = 2000,
    heldout_fraction: float = 0.05,
    max_files: int | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Writes the stdlib corpus as out_dir/train.jsonl and out_dir/heldout.jsonl.

    Each line is `{"text": <chunk of at most seq_chars characters>, "source": <file path
    relative to the stdlib root>}`; the data pipeline reads "text" and ignores
    "source", which is there to check the split and to trace a chunk to its file.
    `max_files` keeps that many files, evenly spaced over the sorted list so a small
    corpus still spans many packages. Deterministic for the same Python, arguments and
    seed. Each file is written to a temporary name and renamed, so a process reading
    it concurrently sees either the old or the new file, never half of one.
    Takes about a second for the full library (~14 MB).
    """
    if seq_chars < 1:
        raise ValueError(f"seq_chars={seq_chars} must be >= 1; use e.g. 2000.")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files={max_files} must be >= 1, or None for every file.")
    root = stdlib_root()
    files = stdlib_files()
    if max_files is not None and max_files < len(files):
        files = [files[i * len(files) // max_files] for i in range(max_files)]
    relative_paths = [path.relative_to(root).as_posix() for path in files]
    heldout = split_files(relative_paths, heldout_fraction, seed)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / TRAIN_FILENAME, "heldout": out_dir / HELDOUT_FILENAME}
    staging = {split: path.with_name(f".{path.name}.tmp-{os.getpid()}") for split, path in paths.items()}
    counts = {split: {"files": 0, "chunks": 0, "chars": 0} for split in paths}
    handles = {split: open(path, "w", encoding="utf-8") for split, path in staging.items()}
    try:
        for path, relative_path in zip(files, relative_paths):
            split = "heldout" if relative_path in heldout else "train"
            # The stdlib is UTF-8 (PEP 3120); a file that is not is a broken install,
            # and the error names it.
            text = path.read_text(encoding="utf-8")
            chunks = chunk_text(text, seq_chars)
            for chunk in chunks:
                handles[split].write(json.dumps({"text": chunk, "source": relative_path}) + "\n")
            counts[split]["files"] += 1
            counts[split]["chunks"] += len(chunks)
            counts[split]["chars"] += sum(len(chunk) for chunk in chunks)
    except BaseException:
        for split, handle in handles.items():
            handle.close()
            staging[split].unlink(missing_ok=True)
        raise
    for split, handle in handles.items():
        handle.close()
        os.replace(staging[split], paths[split])
    for split, count in counts.items():
        logger.info(
            "stdlib corpus %s: %d files, %d chunks, %.2f MB -> %s",
            split, count["files"], count["chunks"], count["chars"] / 1e6, paths[split],
        )
    return paths["train"], paths["heldout"]
