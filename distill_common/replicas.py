"""The replicas one teacher address names (a pool: student_trainer/pool.py places sessions on them).

- `host1:50051,host2:50051`: a comma list;
- `dns:NAME:PORT`: every address NAME resolves to (a Kubernetes headless Service), resolved
  again at each call, so replicas that come and go are seen;
- `file:PATH`: one address per line (`#` starts a comment), read again at each call; a
  directory: its `*.address` files (deploy/slurm: each teacher of a pool writes one);
- anything else: one address, as given.
"""

from __future__ import annotations

import socket
from pathlib import Path


class ReplicasError(ValueError):
    """The address names no replica now (an unreadable file, a name that does not resolve)."""


def single(spec: str) -> bool:
    """Whether `spec` is one fixed address (no pool)."""
    spec = spec.strip()
    return "," not in spec and not spec.startswith(("dns:", "file:"))


def replica_addresses(spec: str) -> list[str]:
    """The addresses `spec` names now, each once, in order."""
    spec = spec.strip()
    if spec.startswith("file:"):
        path = Path(spec[len("file:"):])
        # A directory: each *.address file in it (deploy/slurm: every teacher.sbatch of a pool writes one).
        files = sorted(path.glob("*.address")) if path.is_dir() else [path]
        lines = []
        for file in files:
            try:
                lines += file.read_text().splitlines()
            except FileNotFoundError:
                if file is path:
                    raise ReplicasError(f"the teacher pool's file {path} does not exist") from None
            except OSError as e:
                raise ReplicasError(f"cannot read the teacher pool's file {file}: {e.strerror or e}") from None
        found = [line.split("#", 1)[0].strip() for line in lines]
    elif spec.startswith("dns:"):
        name, _, port = spec[len("dns:"):].lstrip("/").rpartition(":")
        if not name or not port.isdigit():
            raise ReplicasError(f"teacher address {spec!r}: write dns:NAME:PORT")
        try:
            records = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ReplicasError(f"the teacher pool's name {name} does not resolve: {e}") from None
        found = [f"[{r[4][0]}]:{port}" if ":" in r[4][0] else f"{r[4][0]}:{port}" for r in records]
    else:
        found = [part.strip() for part in spec.split(",")]
    unique = list(dict.fromkeys(address for address in found if address))
    if not unique:
        raise ReplicasError(f"the teacher address {spec!r} names no replica")
    return unique
