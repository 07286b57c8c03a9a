"""A hostile student of its own session: it joins with its job's token, then sends over the
session's rendezvous and data plane what an honest student never would.

    python -m tests.hostile_peer ADDRESS TOKEN JOB MODE [MODE ...]

Modes (each a message of the handshake or the data plane, wrong):
- address_length: its gloo address (rendezvous key 0/1) says its host name is 100,000,000 bytes long
- address_garbage: its gloo address is random bytes (several lengths, one per attempt)
- address_short: its gloo address is cut to a few bytes
- proof_long: forms the group, receives the teacher's 16-byte proof and sends 24 bytes back
- proof_short: sends 8 bytes back
- proof_wrong: sends 16 bytes that are not the proof
- close_before_proof: forms the group and closes it before the handshake
- close_mid_batch: proves itself, submits batches and closes its group while they are sent
- unsolicited_send: proves itself, then sends 1 MiB the teacher never asked for, while batches are sent
- raw_garbage: proves itself, then connects to the teacher's gloo socket and writes random bytes and
  forged message preambles
On a CUDA teacher, with this process on the same GPU (tests/gpu/test_hostile_peer_gpu.py):
- nccl_same_gpu: says its GPU is another one (a made-up UUID), then builds its NCCL end on the
  teacher's GPU and answers the handshake
- nccl_bootstrap: reads the NCCL unique id the teacher's end published, connects to the
  bootstrap root it names with the id's magic, and sends forged sizes and random bytes

Each mode joins a session of its own, one after another. For each it prints
`RESULT {"mode", "ended", "alive_after_attack"}`: `ended` is the teacher's reason once it
ended the session (what it tells the session's own secret); a session the attack did not
end within a few seconds (gloo dropped what it was sent) is closed by the peer, and
`alive_after_attack` says so.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import threading
import time

import grpc
import torch

from distill_common import rendezvous
from distill_common.channel import SESSION_SECRET_KEY
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.session_group import STUDENT_RANK, build_group, proof

SERVICE = "/teacher.v1.TeacherService/"
Op = pb.RendezvousRequest.Op
ADDRESS_KEY = "0/1"  # the student's (rank 1) gloo address, under the group's prefix
TEACHER_ADDRESS_KEY = "0/0"


class Peer:
    def __init__(self, address: str, token: str, job_id: str, nccl: bool = False):
        self.channel = grpc.insecure_channel(address)
        self.grpc_port = int(address.rsplit(":", 1)[1])
        self.auth = (("authorization", f"Bearer {token}"),)
        self.join_call = self._call("Join", pb.JoinRequest, pb.JoinResponse)
        self.rendezvous_call = self._call("Rendezvous", pb.RendezvousRequest, pb.RendezvousResponse)
        self.heartbeat_call = self._call("Heartbeat", pb.HeartbeatRequest, pb.HeartbeatResponse)
        self.submit_call = self._call("Submit", pb.SubmitRequest, pb.SubmitResponse)
        peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__)
        if nccl:  # another GPU, it says: the teacher's check of the UUID cannot see through that
            peer = pb.PeerInfo(device_type="cuda", torch_version=torch.__version__,
                               device_uuid="GPU-00000000-0000-0000-0000-000000000000",
                               nccl_version=".".join(map(str, torch.cuda.nccl.version())))
        self.joined = self.join_call(pb.JoinRequest(job_id=job_id, outputs=pb.OutputSpec(logits=True), peer=peer),
                                     metadata=self.auth, timeout=30)
        self.metadata = self.auth + ((SESSION_SECRET_KEY, self.joined.session_secret),)

    def _call(self, name, request, response):
        return self.channel.unary_unary(SERVICE + name, request_serializer=request.SerializeToString,
                                        response_deserializer=response.FromString)

    def store(self) -> rendezvous.RendezvousStore:
        def call(request, timeout_s):
            return self.rendezvous_call(request, metadata=self.metadata, timeout=timeout_s)
        return rendezvous.RendezvousStore(call, self.joined.session_id, timeout_s=10)

    def set(self, key: str, value: bytes) -> None:
        self.rendezvous_call(pb.RendezvousRequest(session_id=self.joined.session_id, op=Op.SET, keys=[key],
                                                  value=value), metadata=self.metadata, timeout=10)

    def group(self, store=None):
        if self.joined.backend == "nccl":
            return build_group(store or self.store(), backend="nccl", rank=STUDENT_RANK,
                               device=torch.device("cuda:0"), timeout_s=10)
        return build_group(store or self.store(), backend="gloo", rank=STUDENT_RANK, device=torch.device("cpu"),
                           timeout_s=10, gloo_host="127.0.0.1")

    def submit(self, batch_id: int) -> None:
        ids = torch.randint(0, 100, (4, 16), dtype=torch.int64)
        request = pb.SubmitRequest(session_id=self.joined.session_id, batch_id=batch_id)
        request.input_ids.dtype, request.input_ids.shape[:], request.input_ids.data = "int64", [4, 16], ids.numpy().tobytes()
        self.submit_call(request, metadata=self.metadata, timeout=10)

    def ended(self, timeout_s: float) -> str | None:
        """The teacher's reason once it ended the session; None if it still lives after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.heartbeat_call(pb.HeartbeatRequest(session_id=self.joined.session_id), metadata=self.metadata,
                                    timeout=10)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return e.details()
                raise
            time.sleep(0.1)
        return None


def drop_connections(keep_port: int) -> int:
    """Resets every TCP connection of this process but those to `keep_port` (the gRPC port): the
    group's sockets close under gloo, as they would if this process died, and the process
    goes on to the next mode. Returns how many it reset."""
    dropped = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] != keep_port:
                sock.shutdown(socket.SHUT_RDWR)
                dropped += 1
        except OSError:  # not connected (a listening socket), or not a socket
            pass
        finally:
            sock.close()
    return dropped


def teacher_gloo_address(value: bytes) -> tuple[str, int]:
    """The IPv4 address and port in gloo's serialized address (host name length, host name,
    sockaddr length, sockaddr): what an attacker reads from the rendezvous it shares."""
    name_length = struct.unpack_from("<Q", value, 0)[0]
    at = 8 + name_length + 8
    family = struct.unpack_from("<H", value, at)[0]
    if family != socket.AF_INET:
        raise ValueError(f"not an IPv4 gloo address (family {family})")
    port = struct.unpack_from(">H", value, at + 2)[0]
    return socket.inet_ntoa(value[at + 4:at + 8]), port


class _Forged(RuntimeError):
    pass


def forge_nccl_bootstrap(value: bytes) -> None:
    """Connects to the bootstrap root named in an NCCL unique id (its magic, then a socket
    address) and sends, after the magic and a socket type, forged lengths and random bytes."""
    magic = value[:8]
    family = struct.unpack_from("<H", value, 8)[0]
    port = struct.unpack_from(">H", value, 10)[0]
    if family == socket.AF_INET:
        host = socket.inet_ntop(socket.AF_INET, value[12:16])
    elif family == socket.AF_INET6:
        host = socket.inet_ntop(socket.AF_INET6, value[16:32])
    else:
        raise ValueError(f"no socket address in the unique id (family {family})")
    rng = random.Random(1)
    for attempt in range(12):
        try:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(magic + struct.pack("<i", 1 + attempt % 3))
                sizes = [0xFFFFFFFF, 1 << 31, 1 << 40, 3, 0][attempt % 5]
                sock.sendall(struct.pack("<Q", sizes) + rng.randbytes(rng.choice([4, 64, 4096])))
                time.sleep(0.05)
        except OSError:  # the root closed or stopped listening
            pass


class _ForgingStore(rendezvous.RendezvousStore):
    """The student's store, except that the first unique id read from it is used to attack the
    teacher's NCCL bootstrap, and this end's own formation is abandoned."""

    def get(self, key):
        value = super().get(key)
        if len(value) == 128:  # sizeof(ncclUniqueId)
            forge_nccl_bootstrap(value)
            raise _Forged("forged the bootstrap")
        return value


def handshake_reply(group, secret: bytes, reply: torch.Tensor) -> None:
    theirs = torch.zeros(2, dtype=torch.int64, device=group.tensor_device)
    group.wait(group.recv(theirs), 10, what="the teacher's proof")
    group.wait(group.send(reply), 10, what="our reply")


def run(mode: str, peer: Peer) -> None:
    secret = peer.joined.session_secret.encode()
    honest_reply = torch.tensor(proof(secret, STUDENT_RANK), dtype=torch.int64)
    if mode.startswith("address_"):
        peer.set("student-arrived", b"1")
        if mode == "address_length":
            value = struct.pack("<Q", 100_000_000) + b"x" * 64
        elif mode == "address_short":
            value = b"\x02\x00\x00"
        else:
            value = random.Random(os.getpid()).randbytes(random.Random(os.getpid()).choice([1, 9, 64, 170, 4096]))
        peer.set(ADDRESS_KEY, value)
        return
    if mode == "nccl_bootstrap":
        store = _ForgingStore(peer.store()._call, peer.joined.session_id, timeout_s=10)
        peer.group_keepalive = store
        try:
            handshake_reply(peer.group(store), secret, honest_reply.cuda())
        except Exception:  # our own end fails once the store refused it the id
            pass
        return
    group = peer.group()
    peer.group_keepalive = group  # the group lives until the mode is over
    honest_reply = honest_reply.to(group.tensor_device)
    if mode == "close_before_proof":
        drop_connections(peer.grpc_port)
        return
    if mode == "proof_long":
        handshake_reply(group, secret, torch.zeros(3, dtype=torch.int64, device=group.tensor_device))
    elif mode == "proof_short":
        handshake_reply(group, secret, torch.zeros(1, dtype=torch.int64, device=group.tensor_device))
    elif mode == "proof_wrong":
        handshake_reply(group, secret, honest_reply + 1)
    else:
        handshake_reply(group, secret, honest_reply)
        if mode == "nccl_same_gpu":
            return
        for batch_id in range(3):
            peer.submit(batch_id)
        if mode == "close_mid_batch":
            time.sleep(0.2)
            drop_connections(peer.grpc_port)
        elif mode == "unsolicited_send":
            group.send(torch.zeros(1 << 18, dtype=torch.float32))  # never received by the teacher
        elif mode == "raw_garbage":
            store = peer.store()
            host, port = teacher_gloo_address(store.get(TEACHER_ADDRESS_KEY))
            rng = random.Random(0)
            for attempt in range(20):
                with socket.create_connection((host, port), timeout=5) as sock:
                    if attempt % 2:  # a forged preamble: opcode, slot, offset, length, roundtrip (gloo's layout)
                        sock.sendall(struct.pack("<QQQQQ", rng.randrange(8), rng.getrandbits(64),
                                                 rng.getrandbits(64), rng.getrandbits(63), 0) * 4)
                    else:
                        sock.sendall(rng.randbytes(rng.choice([1, 16, 300, 70_000])))
                    time.sleep(0.02)
        else:
            raise SystemExit(f"unknown mode {mode!r}")


MODES = ("address_length", "address_garbage", "address_short", "proof_long", "proof_short", "proof_wrong",
         "close_before_proof", "close_mid_batch", "unsolicited_send", "raw_garbage")
NCCL_MODES = ("nccl_same_gpu", "nccl_bootstrap")


def attack(address: str, token: str, job_id: str, mode: str) -> dict:
    peer = Peer(address, token, job_id, nccl=mode in NCCL_MODES)
    worker = threading.Thread(target=run, args=(mode, peer), daemon=True)
    worker.start()
    reason = peer.ended(timeout_s=4)
    alive = reason is None
    if alive:  # the attack did not end the session: close our end, and the teacher ends it
        worker.join(10)
        drop_connections(peer.grpc_port)
        reason = peer.ended(timeout_s=30)
    peer.channel.close()
    return {"mode": mode, "ended": reason, "alive_after_attack": alive}


def main(argv: list[str]) -> None:
    address, token, job_id, *modes = argv
    for mode in modes:
        if mode not in MODES + NCCL_MODES:
            raise SystemExit(f"unknown mode {mode!r}; one of {', '.join(MODES + NCCL_MODES)}")
        print(f"RESULT {json.dumps(attack(address, token, job_id, mode))}", flush=True)
    os._exit(0)  # a hostile group's destructor may wait for the teacher


if __name__ == "__main__":
    main(sys.argv[1:])
