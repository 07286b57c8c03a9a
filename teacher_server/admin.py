"""`teacher-server status ADDRESS` and `teacher-server info ADDRESS`: a running teacher, as tables."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from distill_common.channel import TlsFlags, channel_credentials, connection_hint, open_channel, tls_ca_arg
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.proto.teacher.v1 import teacher_pb2_grpc as pb_grpc


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_info(info: pb.TeacherInfo) -> str:
    rows = [
        ["model", info.model_name], ["architecture", info.architecture], ["dtype", info.dtype],
        ["device", info.device_type], ["tensor parallel", str(info.tp_size)], ["vocab size", str(info.vocab_size)],
        ["hidden size", str(info.hidden_size)], ["layers", str(info.num_layers)],
        ["tokenizer", info.tokenizer_fingerprint[:16] or "(none: vocabularies are not checked)"],
        ["--max-batch-tokens", str(info.max_batch_tokens)], ["--max-seq-len", str(info.max_seq_len)],
        ["--max-sessions", str(info.max_sessions)], ["--max-inflight", str(info.max_inflight)],
        ["torch", info.torch_version], ["nccl", info.nccl_version or "-"],
    ]
    return _table(["field", "value"], rows)


def format_status(status: pb.StatusResponse) -> str:
    head = (f"{status.info.model_name}: {len(status.sessions)} session(s), queue depth {status.queue_depth}, "
            f"busy {status.busy_fraction:.0%}")
    if not status.sessions:
        return head + "\n(no sessions)"
    rows = [[s.session_id, s.job_id, str(s.job_rank), s.backend, s.state, str(s.tokens_served),
             f"{s.batches_sent}/{s.batches_submitted}", str(s.inflight), _bytes(s.bytes_sent),
             f"{s.last_heartbeat_age_s:.1f}s ago"] for s in status.sessions]
    return head + "\n" + _table(["session", "job", "rank", "backend", "state", "tokens", "batches sent",
                                 "in flight", "sent", "heartbeat"], rows)


def main(command: str, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"teacher-server {command}",
                                     description=f"Print the {command} of a running teacher server.")
    parser.add_argument("address", help="the teacher's gRPC address, HOST:PORT")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--auth-token", default=os.environ.get("TEACHER_AUTH_TOKEN", ""),
                        help="the teacher's --auth-token (default: $TEACHER_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", default="",
                        help="talk TLS to a teacher started with --tls-cert: the PEM CA that signed its certificate, "
                             "or 'system' for the system's roots")
    parser.add_argument("--tls-cert", default="", help="client certificate (PEM), for a teacher with --tls-client-ca")
    parser.add_argument("--tls-key", default="", help="the key of --tls-cert (PEM)")
    args = parser.parse_args(argv)
    flags = TlsFlags(ca="--tls-ca", cert="--tls-cert", key="--tls-key")
    tls_ca = tls_ca_arg(args.tls_ca)
    try:
        credentials = channel_credentials(tls_ca, args.tls_cert or None, args.tls_key or None, flags)
    except ValueError as e:
        parser.error(str(e))
    with open_channel(args.address, credentials) as channel:
        stub = pb_grpc.TeacherServiceStub(channel)
        metadata = (("authorization", f"Bearer {args.auth_token}"),) if args.auth_token else ()
        try:
            if command == "info":
                print(format_info(stub.GetInfo(pb.GetInfoRequest(), timeout=args.timeout_s, metadata=metadata)))
            else:
                print(format_status(stub.GetStatus(pb.GetStatusRequest(), timeout=args.timeout_s,
                                                   metadata=metadata)))
        except grpc.RpcError as e:
            hint = connection_hint(e.details() or "", bool(tls_ca), flags) \
                if e.code() == grpc.StatusCode.UNAVAILABLE else ""
            print(f"teacher-server {command}: {args.address} answered {e.code().name}: {e.details()}"
                  + (f"\n{hint}" if hint else ""), file=sys.stderr)
            return 1
    return 0
