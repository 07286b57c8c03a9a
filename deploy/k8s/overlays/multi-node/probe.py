"""Kubernetes probes for a teacher spread over several pods (overlays/multi-node).

Only node rank 0 runs the gRPC and HTTP servers; the pods of the other node ranks have no
endpoint of their own. So, by NODE_RANK (the pod's ordinal):

    probe.py live    rank 0: GET /healthz on this pod.  Other ranks: succeed; torchrun ends
                     the pod when one of its ranks dies, and a frozen rank shows up as
                     rank 0's engine failing.
    probe.py ready   GET /readyz on rank 0 (this pod, or TEACHER_LEADER_HOST): a pod is ready
                     when the teacher it belongs to is.

Exit status 0 = success, 1 = failure (the reason on stderr), as exec probes expect.
Environment: NODE_RANK, TEACHER_HTTP_PORT, TEACHER_LEADER_HOST, PROBE_TIMEOUT_S (default 3).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("live", "ready"):
        print("usage: probe.py live|ready", file=sys.stderr)
        return 2
    kind = argv[1]
    leader = os.environ.get("NODE_RANK", "0") == "0"
    if kind == "live" and not leader:
        return 0
    host = "127.0.0.1" if leader else os.environ["TEACHER_LEADER_HOST"]
    path = "/healthz" if kind == "live" else "/readyz"
    url = f"http://{host}:{os.environ.get('TEACHER_HTTP_PORT', '8000')}{path}"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("PROBE_TIMEOUT_S", "3"))):
            return 0  # urlopen raises for any status other than 2xx/3xx
    except (urllib.error.URLError, OSError) as e:
        print(f"{kind}: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
