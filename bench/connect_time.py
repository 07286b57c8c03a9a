"""How long a real session stays "connecting": from its Join to its process group formed.

The teacher ends a session still connecting after --join-timeout-s (a join whose group
never forms would otherwise hold a --max-sessions slot); this measures what a real group
formation needs, to set that default with a margin. Sessions join one after another, then
--sessions at once, then --sessions at once while another job keeps the teacher busy.
Times are the teacher's own (its JSON log: "joined" to "ready" of each session), and the
client's (TeacherClient's constructor: Join, group, handshake).

    python -m bench.connect_time --out connect.md                          # CPU, gloo
    python -m bench.connect_time --teacher-device cuda:0 --student-device cuda:1 --out connect_gpu.md
    python -m bench.connect_time --session-transport process,inline   # each, side by side
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import threading
import time

import torch

from bench.table import emit
from student_trainer import TeacherClient
from teacher_server.launcher import ServerProcess, child_env, multicast_off


def _teacher_times(log_lines: list[str], session_ids: set[str]) -> list[float]:
    """Seconds from "joined" to "ready" of each session in `session_ids`, from the JSON log."""
    joined, ready = {}, {}
    for line in log_lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        session = record.get("session_id")
        if session not in session_ids:
            continue
        at = datetime.datetime.fromisoformat(record["ts"]).timestamp()
        if record["message"].startswith(f"session {session} joined"):
            joined[session] = at
        elif record["message"].startswith(f"session {session} ready"):
            ready[session] = at
    return [ready[s] - joined[s] for s in session_ids if s in joined and s in ready]


def _join(address: str, device: str, job_id: str, clients: list, times: list, errors: list) -> None:
    start = time.monotonic()
    try:
        clients.append(TeacherClient(address, device, job_id=job_id, join_timeout_s=120))
        times.append(time.monotonic() - start)
    except Exception as e:  # reported in the table's last column
        errors.append(repr(e))


def _phase(server: ServerProcess, device: str, sessions: int, at_once: bool) -> dict:
    clients, client_times, errors = [], [], []
    if at_once:
        threads = [threading.Thread(target=_join, args=(server.address, device, f"connect-{i}", clients,
                                                        client_times, errors)) for i in range(sessions)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    else:
        for i in range(sessions):
            _join(server.address, device, f"connect-{i}", clients, client_times, errors)
    ids = {client.session_id for client in clients}
    time.sleep(0.5)  # the "ready" lines are logged
    teacher_times = _teacher_times(server.log_lines, ids)
    for client in clients:
        client.close()
    return {"teacher": teacher_times, "client": client_times, "errors": errors}


def _saturate(address: str, device: str, stop: threading.Event) -> None:
    with TeacherClient(address, device, job_id="busy", max_inflight=4, join_timeout_s=120) as teacher:
        futures = []
        while not stop.is_set():
            futures.append(teacher.submit(torch.randint(0, teacher.info.vocab_size, (4, 256))))
            if len(futures) >= 4:
                futures.pop(0).result(timeout=300)
        for future in futures:
            future.result(timeout=300)


def _row(name: str, sessions: int, result: dict) -> str:
    def stats(values: list[float]) -> str:
        if not values:
            return "- | -"
        return f"{statistics.median(values):.2f} | {max(values):.2f}"

    return (f"| {name} | {sessions} | {stats(result['teacher'])} | {stats(result['client'])} | "
            f"{'; '.join(result['errors'])[:200] or 'none'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--teacher-device", default="cpu")
    parser.add_argument("--student-device", default="cpu")
    parser.add_argument("--sessions", type=int, default=8, help="sessions per phase")
    parser.add_argument("--session-transport", default="process",
                        help="the teacher's --session-transport; a comma list measures each in turn")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    env = child_env()
    multicast_off(env)
    rows = []
    for transport in args.session_transport.split(","):
        with ServerProcess("--model", args.model, "--device", args.teacher_device, "--log-format", "json",
                           "--max-sessions", str(args.sessions + 2), "--max-seq-len", "256",
                           "--max-batch-tokens", "1024", "--session-transport", transport, env=env) as server:
            rows.append(_row(f"{transport}: one after another", args.sessions,
                             _phase(server, args.student_device, args.sessions, at_once=False)))
            rows.append(_row(f"{transport}: at once", args.sessions,
                             _phase(server, args.student_device, args.sessions, at_once=True)))
            stop = threading.Event()
            busy = threading.Thread(target=_saturate, args=(server.address, args.student_device, stop))
            busy.start()
            time.sleep(2.0)
            try:
                rows.append(_row(f"{transport}: at once, teacher busy", args.sessions,
                                 _phase(server, args.student_device, args.sessions, at_once=True)))
            finally:
                stop.set()
                busy.join(timeout=300)
    emit([f"Join to group formed, {args.teacher_device} teacher, {args.student_device} students "
          f"(`python -m bench.connect_time`), seconds:", "",
          "| session transport: joins | sessions | teacher p50 | teacher max | client p50 | client max | errors |",
          "|---|---|---|---|---|---|---|", *rows], args.out)


if __name__ == "__main__":
    main()
