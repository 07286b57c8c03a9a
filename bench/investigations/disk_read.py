"""How fast this machine's local disk gives a file to one process: the ceiling of the store's reads.

    python3 -m bench.investigations.disk_read --dir /tmp --size-gib 2

Writes one file of `--size-gib` (random bytes, synced), then reads it whole again and again, each
time after dropping it from the page cache (posix_fadvise DONTNEED), in chunks spread over
threads: buffered reads (what the store's reader does, os.preadv into a host buffer) and O_DIRECT
reads (no page cache, page-aligned buffers), for each thread count and chunk size asked. Also the
rate of sha256 (hashlib, the store's row digests) on one thread and on several. Prints GB/s
(10^9 bytes a second).

The question it answers (issue 26): whether reading final hidden states, 8 KiB a token, at 10x the
1.5B student's 35.4k tokens/s (2.9 GB/s) is a matter of the reader or of the disk under it.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.table import emit

MiB = 2**20


def write_file(path: Path, size: int) -> None:
    block = os.urandom(64 * MiB)
    with open(path, "wb") as f:
        written = 0
        while written < size:
            f.write(block[:min(len(block), size - written)])
            written += min(len(block), size - written)
        f.flush()
        os.fsync(f.fileno())


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


MODES = ("buffered", "buffered + WILLNEED", "O_DIRECT")


def read_all(path: Path, size: int, threads: int, chunk: int, mode: str) -> float:
    """Seconds to read the file whole: chunk i by thread i % threads, each thread in order.
    `mode`: buffered reads; buffered reads with each chunk and the thread's next one announced to the
    kernel first (posix_fadvise WILLNEED: it starts reading them at once, many requests in flight,
    where a plain read goes a readahead window at a time); or O_DIRECT reads."""
    drop(path)
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "O_DIRECT" else 0)
    fd = os.open(path, flags)
    offsets = list(range(0, size, chunk))

    def worker(first: int) -> int:
        buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        view = memoryview(buffer)
        done = 0
        mine = offsets[first::threads]
        for index, offset in enumerate(mine):
            want = min(chunk, size - offset)
            if mode == "buffered + WILLNEED":
                if index == 0:
                    os.posix_fadvise(fd, offset, want, os.POSIX_FADV_WILLNEED)
                if index + 1 < len(mine):
                    os.posix_fadvise(fd, mine[index + 1], min(chunk, size - mine[index + 1]), os.POSIX_FADV_WILLNEED)
            got = 0
            while got < want:
                count = os.preadv(fd, [view[got:want]], offset + got)
                if count <= 0:
                    raise RuntimeError(f"{path} ended at {offset + got}")
                got += count
            done += got
        view.release()
        buffer.close()
        return done

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(worker, range(threads)))
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    assert total == size, (total, size)
    return seconds


def hash_rate(threads: int, size: int = 256 * MiB) -> float:
    data = os.urandom(32 * MiB)

    def worker(_: int) -> None:
        for _ in range(size // len(data)):
            hashlib.sha256(data).digest()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return threads * size / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--chunks-mib", default="32,4,1", help="chunk sizes (MiB); 32 MiB is one 8B row's hidden state")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    size = int(args.size_gib * 2**30) // MiB * MiB
    path = Path(args.dir) / "disk-read-probe.bin"
    lines = [f"Reading a {size / 2**30:.1f} GiB file in {args.dir} after dropping it from the page cache (GB/s)", "",
             "| reads | chunk | threads | GB/s |", "|---|---:|---:|---:|"]
    figures = []
    try:
        start = time.perf_counter()
        write_file(path, size)
        write_gbs = size / (time.perf_counter() - start) / 1e9
        for mode in args.modes.split(","):
            for chunk_mib in (int(c) for c in args.chunks_mib.split(",")):
                for threads in (int(t) for t in args.threads.split(",")):
                    seconds = read_all(path, size, threads, chunk_mib * MiB, mode)
                    gbs = size / seconds / 1e9
                    figures.append({"mode": mode, "chunk_mib": chunk_mib, "threads": threads, "gb_per_s": gbs})
                    lines.append(f"| {mode} | {chunk_mib} MiB | {threads} | {gbs:.2f} |")
                    print(lines[-1], flush=True)
    finally:
        path.unlink(missing_ok=True)
    hashes = {threads: hash_rate(threads) for threads in (1, 4)}
    lines += ["", f"Writing it (one thread, then fsync): {write_gbs:.2f} GB/s; sha256: "
              + ", ".join(f"{gbs:.2f} GB/s on {threads} thread{'s' * (threads > 1)}" for threads, gbs in hashes.items())]
    emit(lines, args.out, {"reads": figures, "write_gb_per_s": write_gbs,
                           "sha256_gb_per_s": {str(k): v for k, v in hashes.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
