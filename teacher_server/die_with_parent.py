"""A process that ends when the process that started it ends (Linux: PR_SET_PDEATHSIG).

Imported first in the session transports' forkserver (session_process's preload list), so the
forkserver dies with the teacher even while it is still importing torch, seconds on a busy
machine: otherwise a teacher stopped during that time leaves it running, and holding the
teacher's stdout open, until the import ends. The session transport processes call `arm()`
too. The kernel sends the signal when the thread that started the process exits; both are
started from the teacher's main thread, which is the last to go.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def arm() -> None:
    """SIGKILL this process when its parent exits; exits now if the parent is already gone."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a closed pipe still ends these processes
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)


arm()
