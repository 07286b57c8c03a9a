"""A real teacher server whose data plane goes wrong on purpose, for the tests of what the client
does then (tests/test_data_plane_header.py). Everything else is `python -m teacher_server`.

    ServerProcess(..., module="tests.tampering_teacher", env=child_env(TAMPER_AT="2"))

For the first session of each job whose id starts with:
- "stale": batch TAMPER_AT (its id on the session's wire) is sent the outputs of the batch
  before it, with that batch's header, and announced as itself. This is what a skipped
  receive did to a student when the announcements were in a public store: the next
  batch of the same shape resolved with the previous batch's outputs.
- "fail": batch TAMPER_AT is failed with `Delivery.fail` (nothing of it is sent): the hook
  the engine's own per-batch failures will use.
Later sessions of the job (after a reconnect) are served honestly.
"""

from __future__ import annotations

import os
import sys

from teacher_server import delivery
from teacher_server.__main__ import main

TAMPER_AT = int(os.environ.get("TAMPER_AT", "-1"))
_send = delivery.Delivery._send
_previous: dict[str, tuple] = {}  # by session id: the last (batch, outputs) sent honestly
_tampered_jobs: set[str] = set()


def tampered_send(self, session, batch, out, derived):
    mode = next((mode for mode in ("stale", "fail") if session.job_id.startswith(mode)), None)
    if mode is None or batch.batch_id != TAMPER_AT or session.job_id in _tampered_jobs:
        _previous[session.session_id] = (batch, out)
        return _send(self, session, batch, out, derived)
    _tampered_jobs.add(session.job_id)
    print(f"TAMPERED {mode} session {session.session_id} batch {batch.batch_id}", flush=True)
    if mode == "fail":
        self.fail(session, batch, "injected by the test teacher")
        return None
    previous_batch, previous_out = _previous[session.session_id]
    launched = _send(self, session, previous_batch, previous_out, derived)
    # Announced under this batch's id: the student posts this batch's receives for it.
    return None if launched is None else (*launched[:-1], batch.batch_id)


delivery.Delivery._send = tampered_send

if __name__ == "__main__":
    sys.exit(main())
