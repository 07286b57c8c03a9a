"""The announce/refuse handshake: how a student learns that a batch's sends are posted.

Why: an NCCL receive posted before its send spins on the student's GPU, holding SMs its
training needs for as long as the teacher takes to compute the batch. So the student
posts a batch's receives only once the teacher has *announced* the batch: its outputs
exist and its sends are posted.

Where: on the teacher's TCPStore, under the session's secret prefix
(`teacher-session/<prefix>/ready`), one key per batch: its batch id on the session's wire
(`SubmitRequest.batch_id`) in decimal.

Who writes what:
- The teacher writes ANNOUNCED once the forward that computed the batch finished and
  the batch's sends are posted.
- The teacher writes REFUSED for a batch it refused, when the session joined with
  `JoinRequest.stream_refusals_only`: such a student waits for the announcement of every
  batch it streamed, since an accepted batch gets no answer on the stream, and the mark
  ends that wait. The reason travels on the submit stream, not here.
- The student writes REFUSED itself to end its own wait: for a refusal the teacher did
  not mark (a batch id out of order, which the teacher did not take), or for a session
  it gives up.
- The student deletes a key once it has read it, so the store does not grow. Not the
  teacher once its send completed: a small NCCL send completes before its receive is
  posted (NCCL buffers it at the peer), so the teacher could delete an announcement the
  student has not read yet.

Connections: a store client runs one operation at a time. The student waits for
announcements on a connection of its own, and ends a wait through another one (the
session group's): a mark made on the waiting connection would queue behind the wait it
is meant to end. For the same reason the teacher gives each session's group a store
connection of its own: a session whose student is slow to read holds up no other.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)

ANNOUNCED, REFUSED = b"1", b"refused"


class NotAnnounced(RuntimeError):
    """A batch was neither announced nor refused in time: the teacher is stuck, or its store is gone."""


def ready_store(store: dist.Store, prefix: str) -> dist.PrefixStore:
    """The keys of one session's announcements, on `store` (one connection to the teacher's TCPStore)."""
    return dist.PrefixStore(f"teacher-session/{prefix}/ready", store)


class Announcements:
    """One session's announcements, read and written over one store connection."""

    def __init__(self, store: dist.Store, prefix: str):
        self.store = ready_store(store, prefix)

    def announce(self, batch_id: int) -> None:
        """Teacher: the batch's outputs exist and its sends are posted; the student may post its receives."""
        self.store.set(str(batch_id), ANNOUNCED)

    def refuse(self, batch_id: int) -> None:
        """Teacher: the batch was refused and will never be sent; a student waiting for it wakes."""
        self.store.set(str(batch_id), REFUSED)

    def await_announced(self, batch_id: int, timeout_s: float) -> bool:
        """Student: blocks (GIL released) until `batch_id` is announced or refused, then forgets it.

        True: its sends are posted; False: it was marked refused (by the teacher, or by
        `end_wait`). Two round trips to the store: a `get` waits for the key (up to the
        store's timeout, set here: this must be a connection of the waiting thread's own),
        then a delete.
        """
        key = str(batch_id)
        try:
            self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
            value = self.store.get(key)
        except Exception as e:  # torch raises DistStoreError / RuntimeError subclasses
            raise NotAnnounced(f"the teacher did not get to batch {batch_id} within {timeout_s:.0f}s: {e}") from e
        self.store.delete_key(key)
        return value != REFUSED

    def end_wait(self, batch_id: int) -> None:
        """Student: a wait for `batch_id` on another connection returns False (it is marked refused).

        Never raises: when the teacher's store is gone, that wait fails by itself.
        """
        try:
            self.refuse(batch_id)
        except Exception as e:
            log.debug("could not end the wait for batch %d: %s", batch_id, e)
