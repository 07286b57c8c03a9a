"""Nothing a client can do stops the teacher for the others: each attack that once did, run
beside an honest student (a real process that compares every batch with the local model).

Attacks (tests/attacks.py): HTTP bodies trickled a byte a second, HTTP requests pipelined and
their answers never read, idle gRPC connections past the connection cap, half-open calls of
one job, rendezvous waits naming thousands of keys, sessions that never receive (of a heavy
job too), cross-tokenizer Joins with a 128,000-entry vocabulary refused for the job's session
cap or for matching nothing, cross-tokenizer batches refused once re-tokenized, and hostile
students of their own sessions' data plane (tests/hostile_peer.py). While each runs: /healthz
answers at least 95% of probes, the operator's GetInfo answers within 1 s at the 99th
percentile, and the honest session is served and neither expires nor reconnects (checked at
the end: its report). A second honest student, of another tokenizer (its text re-tokenized by
the teacher), has its batches' latency bounded under the cross-tokenizer attacks, and every
answer equal to the one it had before them. The default
suite runs each for a few seconds on one shared teacher; the slow version runs each for five
rounds of 12 s and checks that the teacher's memory comes back after each round.
"""

from __future__ import annotations

import contextlib
import json
import time

import grpc
import pytest
import requests
import torch
from transformers import PreTrainedTokenizerFast

from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from teacher_server.launcher import ServerProcess, child_env
from tests.attacks import (CrossStudent, HalfOpenCalls, HostilePeers, IdleConnections, Observer, PipelinedUnread,
                           RefusedCrossBatches, RendezvousWaits, SlowBodies, SlowConsumers, UnreadRefusals,
                           VocabularyJoins, Watch, bearer, rss_mib, transport_processes)
from tests.helpers import build_tiny_model, finish_student, free_port, start_student, wait_for_line, wait_until
from tests.hostile_peer import MODES
from tests.test_alignment import STUDENT_MERGES, TEACHER_MERGES, byte_level_tokenizer

OPERATOR = "availability-operator-token"
ATTACKER = "attacker-job-token-0123456789"
HONEST = "honest-job-token-0123456789ab"
HEAVY = "heavy-job-token-0123456789abc"  # an entry without max_weight: joins at --max-weight (100)
GRPC_MAX_CONNECTIONS = 1024
HTTP_MAX_CONNECTIONS = 32
HELD_LIMIT_BYTES = 4 << 20
# A cross-tokenizer student may send this many vocabulary entries at join (Llama-3's has 128,256); it
# sets --max-request-bytes (14 bytes an entry + 64 KiB: 1.8 MiB), which every call may fill.
MAX_STUDENT_VOCAB = 128_000
# As many keys as fit such a request.
RENDEZVOUS_KEYS = 180_000
ATTACK_SHAPE = (4, 256)  # a slow consumer's batch: 1024 tokens of float32 logits, 1.5 MiB
# The heavy job's slow consumers: three sessions at weight 100 whose batches (1.31 MiB each) fill
# the held limit to within 64 KiB, less than the honest student's larger batches (up to 72
# tokens of logits, top-5 and two hidden layers: 138 KiB).
HEAVY_SESSIONS, HEAVY_SHAPE, HEAVY_WEIGHT = 3, (4, 224), 100.0
SHORT_S = 2.0
LEASE_S = 4.0
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, with a byte-level tokenizer: what cross-tokenizer students are re-tokenized with."""
    path = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model")
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(TEACHER_MERGES)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The teacher, and the honest student started just before it on the same ports (it loads
    its model while the teacher starts, then joins): see `honest`."""
    tokens = tmp_path_factory.mktemp("tokens") / "tokens.json"
    tokens.write_text(json.dumps({"attacker": {"token": ATTACKER, "max_sessions": 3},
                                  "honest": {"token": HONEST, "max_sessions": 2},
                                  "heavy": {"token": HEAVY, "max_sessions": HEAVY_SESSIONS}}))
    grpc_port, http_port = free_port(), free_port()
    work = tmp_path_factory.mktemp("honest")
    stop, out = work / "stop", work / "report.json"
    student = start_student(f"127.0.0.1:{grpc_port}", model_dir, out, "--batches", "0", "--stop-file", str(stop),
                            "--topk", "5", "--hidden-layers", "0,2", "--max-len", "24", "--job-id", "honest",
                            "--pause-s", "0.02", env=child_env(TEACHER_AUTH_TOKEN=HONEST))
    try:
        server = ServerProcess("--model", str(model_dir), "--port", str(grpc_port), "--http-port", str(http_port),
                               "--max-sessions", "8", "--max-batch-tokens", "2048",
                               "--max-seq-len", "512", "--lease-s", str(LEASE_S), "--heartbeat-interval-s", "0.5",
                               "--join-timeout-s", "5", "--job-tokens", str(tokens),
                               "--http-max-connections", str(HTTP_MAX_CONNECTIONS), "--http-header-timeout-s", "2",
                               "--http-send-timeout-s", "2",
                               "--grpc-idle-timeout-s", "2", "--request-timeout-s", "3",
                               "--grpc-max-connections", str(GRPC_MAX_CONNECTIONS),
                               "--max-held-bytes", str(HELD_LIMIT_BYTES), "--transfer-timeout-s", "60",
                               "--max-student-vocab", str(MAX_STUDENT_VOCAB),
                               env=child_env(TEACHER_AUTH_TOKEN=OPERATOR))
    except BaseException:
        student.kill()
        raise
    server.honest_student = (student, out, stop)
    yield server
    if student.poll() is None:
        student.kill()
    server.stop()


@pytest.fixture(scope="module")
def honest(server):
    """An honest student through every attack: at the end, every batch it received equals the
    local model's, and it kept its first session throughout. Its session id."""
    proc, out, stop = server.honest_student
    session_id = wait_for_line(proc, "JOINED").split()[1]
    yield session_id
    stop.touch()
    report = finish_student(proc, out)
    assert report["reconnects"] == 0 and report["session_id"] == session_id, report
    assert report["checked"] == len(report["received"]) > 0
    assert all(value < TOLERANCE for value in report["worst"].values()), report["worst"]


@pytest.fixture(scope="module")
def observer(server):
    observer = Observer(server, OPERATOR)
    yield observer
    observer.close()


@pytest.fixture(scope="module")
def cross_student(server, honest):
    """An honest student of the honest job with a tokenizer of its own (tests/attacks.py CrossStudent)."""
    student = CrossStudent(server.address, HONEST, "honest", byte_level_tokenizer(STUDENT_MERGES).to_str(),
                           CROSS_TEXTS)
    with student.window() as quiet:  # its latency with no attack running
        time.sleep(SHORT_S)
    student.quiet = quiet
    print(f"quiet: {quiet.summary()}")
    yield student
    student.close()


def honest_batches_sent(server, session_id: str) -> int:
    """The honest session's batches sent so far; fails if it is gone (expired)."""
    status = requests.get(f"{server.http}/v1/status", headers={"Authorization": f"Bearer {OPERATOR}"},
                          timeout=10).json()
    session = next((s for s in status["sessions"] if s["session_id"] == session_id), None)
    assert session is not None, f"the honest session {session_id} is gone: {status['sessions']}"
    return session["batches_sent"]


def live_sessions(server) -> int:
    status = requests.get(f"{server.http}/v1/status", headers={"Authorization": f"Bearer {OPERATOR}"},
                          timeout=10).json()
    return len(status["sessions"])


def under_attack(attack, observer: Observer, server, honest: str, seconds: float, during=None,
                 cross: CrossStudent | None = None) -> Watch:
    """Runs `attack` for `seconds` with the honest side watching (and `cross`'s batches: `watch.cross`);
    checks what it saw."""
    sent_before = honest_batches_sent(server, honest)
    with contextlib.ExitStack() as stack:
        watch = stack.enter_context(observer.watch())
        watch.cross = stack.enter_context(cross.window()) if cross is not None else None
        stack.enter_context(attack)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if during is not None:
                during()
            time.sleep(0.2)
    assert watch.healthz_fraction >= 0.95, watch.summary()
    assert watch.get_info_p99_s < 1.0, watch.summary()
    assert honest_batches_sent(server, honest) > sent_before, f"the honest session was not served: {watch.summary()}"
    return watch


ATTACKS = {
    "slow_bodies": lambda server: SlowBodies(server.http_port, 80),
    "pipelined_unread": lambda server: PipelinedUnread(server.http_port, HTTP_MAX_CONNECTIONS),
    "idle_connections": lambda server: IdleConnections(server.grpc_port, GRPC_MAX_CONNECTIONS + 200),
    "half_open_calls": lambda server: HalfOpenCalls(server.address, ATTACKER),
    "unread_refusals": lambda server: UnreadRefusals(server.address, ATTACKER),
    "slow_consumers": lambda server: SlowConsumers(server.address, ATTACKER, "attacker", shape=ATTACK_SHAPE),
    "heavy_slow_consumers": lambda server: SlowConsumers(server.address, HEAVY, "heavy", sessions=HEAVY_SESSIONS,
                                                         shape=HEAVY_SHAPE, weight=HEAVY_WEIGHT),
    "rendezvous_waits": lambda server: RendezvousWaits(server.address, ATTACKER, "attacker", keys=RENDEZVOUS_KEYS),
    "vocabulary_joins_at_the_cap": lambda server: VocabularyJoins(server.address, ATTACKER, "attacker",
                                                                  entries=MAX_STUDENT_VOCAB, hold_cap=True),
    "vocabulary_joins_matching_nothing": lambda server: VocabularyJoins(server.address, ATTACKER, "attacker",
                                                                        entries=MAX_STUDENT_VOCAB, hold_cap=False),
    "cross_batches_refused_once_retokenized": lambda server: RefusedCrossBatches(server.address, ATTACKER, "attacker"),
    "hostile_peers": lambda server: HostilePeers(server.address, ATTACKER, "attacker"),
}

# What the teacher says ended each hostile session: the process of its transport killed by
# what its peer sent (the teacher itself died of these two before), or its checks refusing it.
HOSTILE_ENDINGS = {
    "address_length": "transport process was ended by SIG",
    "proof_long": "transport process was ended by SIGABRT",
    "address_garbage": "did not form",
    "address_short": "did not form",
    "proof_short": "did not prove it is the student",
    "proof_wrong": "did not prove it is the student",
    "close_before_proof": "did not form",
    "close_mid_batch": "transfer_failed",
    "unsolicited_send": "has ended",
    "raw_garbage": "has ended",
}
# Attacks that cost the teacher CPU time per call (vocabularies matched, batches re-tokenized): the
# cross-tokenizer student runs beside them.
CHARGED = {"vocabulary_joins_at_the_cap", "vocabulary_joins_matching_nothing", "cross_batches_refused_once_retokenized"}
# The cross-tokenizer student's batches under such an attack: p50 within this many times its
# quiet p50 plus CROSS_NOISE_S, every answer equal to its first. A batch may wait for the one
# attacker's join being matched (128,000 entries, about 60 ms on this machine's two cores, shared
# with the attacker's client: p50 81-84 ms against a quiet 10-14 ms); charged work that did not wait
# behind its own job would queue it behind all the attacker's joins at once.
CROSS_SLOWDOWN = 3.0
CROSS_NOISE_S = 0.1
CROSS_TEXTS = ["def hello(world):\n    return 1234  # café", "x = [12, 345]\nprint(x) and hello world 1234"]


def check_cross(watch: Watch, cross: CrossStudent) -> None:
    window = watch.cross
    assert not window.errors and window.latencies_s and window.worst <= TOLERANCE, window.summary()
    bound_s = CROSS_SLOWDOWN * cross.quiet.percentile_s(0.5) + CROSS_NOISE_S
    assert window.percentile_s(0.5) <= bound_s, f"{window.summary()}; quiet: {cross.quiet.summary()}"


def test_http_bodies_trickled_a_byte_a_second(server, observer, honest):
    attack = ATTACKS["slow_bodies"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S)
    # Gigabyte bodies are refused at their headers; the others end at the request deadline
    # (2 s) or when a newer connection displaces them.
    assert attack.counts["413"] > 0 and attack.counts["closed by the teacher"] > 40, attack.counts
    assert watch.peak_descriptors < 400, watch.summary()


def test_http_requests_pipelined_and_never_read(server, observer, honest):
    attack = ATTACKS["pipelined_unread"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S)
    # As many as the cap: each probe displaces the oldest connection that pipelines (the
    # others close once their answers have waited 2 s, past this short run).
    assert attack.counts["requests sent"] > 20_000 and attack.counts["closed by the teacher"] > 0, attack.counts
    assert watch.peak_descriptors < 400, watch.summary()


def test_idle_grpc_connections_past_the_cap(server, observer, honest):
    attack = ATTACKS["idle_connections"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S)
    # Past the cap new connections close at once; the rest after the idle timeout (2 s).
    assert attack.counts["closed by the teacher"] > 200, attack.counts
    assert watch.peak_descriptors < GRPC_MAX_CONNECTIONS + 600, watch.summary()


def test_half_open_calls_of_one_job_refuse_only_that_job(server, observer, honest):
    attack = ATTACKS["half_open_calls"](server)
    under_attack(attack, observer, server, honest, SHORT_S)
    assert attack.counts["RESOURCE_EXHAUSTED"] > 100, attack.counts
    assert "job 'attacker' has" in attack.details["RESOURCE_EXHAUSTED"], attack.details


def test_submit_streams_that_never_read_their_refusals_hold_a_bounded_number(server, observer, honest):
    """Refused requests written as fast as the teacher takes them, their answers never read (the
    client's receive window small): once 256 answers wait, the teacher stops reading that stream
    until they go out. It held them all before: 121 MB more in these 12 s (700 MB a minute in an
    outside check), against about 30 MB now (gRPC's and the allocator's, given back at the end)."""
    attack = ATTACKS["unread_refusals"](server)
    start_mib = rss_mib(server.proc.pid)
    watch = under_attack(attack, observer, server, honest, 6 * SHORT_S)
    assert attack.counts["requests written"] > 50_000, attack.counts
    assert watch.peak_rss_mib < start_mib + 75, f"{watch.summary()}; at the start {start_mib:.0f} MiB"


def test_sessions_that_never_receive_hold_their_share_only(server, observer, honest):
    attack = ATTACKS["slow_consumers"](server)
    held = []

    def sample() -> None:
        status = requests.get(f"{server.http}/v1/status", headers={"Authorization": f"Bearer {OPERATOR}"},
                              timeout=10).json()
        held.append(status["held_bytes"])
        assert status["held_bytes_limit"] == HELD_LIMIT_BYTES

    under_attack(attack, observer, server, honest, SHORT_S, during=sample)
    assert attack.counts["submitted"] == 16, attack.counts
    # At most the limit plus one batch (a session holding nothing may take one past its share).
    batch_bytes = ATTACK_SHAPE[0] * ATTACK_SHAPE[1] * 384 * 4
    assert 0 < max(held) <= HELD_LIMIT_BYTES + batch_bytes, held


def test_a_heavy_job_that_never_receives_leaves_the_others_a_batch_at_a_time(server, observer, honest):
    """The honest job (weight 1) against one of weight 100 whose sessions never receive: its
    share of the held limit (1/101, 41 KiB) is smaller than its batches, and the heavy job's
    outputs fill the rest. It still gets its floor, one batch held at a time, whatever the other
    holds: served at least a quarter as fast as alone, and at least 2 batches/s."""
    sent, started = honest_batches_sent(server, honest), time.monotonic()
    time.sleep(2.0)
    alone_per_s = (honest_batches_sent(server, honest) - sent) / (time.monotonic() - started)
    attack = ATTACKS["heavy_slow_consumers"](server)
    samples = []  # (monotonic s, honest batches sent, held bytes)

    def sample() -> None:
        status = requests.get(f"{server.http}/v1/status", headers={"Authorization": f"Bearer {OPERATOR}"},
                              timeout=10).json()
        session = next((s for s in status["sessions"] if s["session_id"] == honest), None)
        assert session is not None, f"the honest session {honest} is gone: {status['sessions']}"
        samples.append((time.monotonic(), session["batches_sent"], status["held_bytes"]))

    under_attack(attack, observer, server, honest, 4.0, during=sample)
    assert attack.counts["submitted"] == 8 * HEAVY_SESSIONS, attack.counts
    heavy_batch_bytes = HEAVY_SHAPE[0] * HEAVY_SHAPE[1] * 384 * 4
    # From when the heavy job holds a batch per session to the end of the attack.
    filled = [i for i, (_, _, held) in enumerate(samples) if held >= HEAVY_SESSIONS * heavy_batch_bytes]
    assert filled and samples[-1][0] - samples[filled[0]][0] >= 1.5, f"the heavy job never filled its share: {samples}"
    (t0, sent0, _), (t1, sent1, _) = samples[filled[0]], samples[-1]
    attacked_per_s = (sent1 - sent0) / (t1 - t0)
    print(f"honest batches/s: alone {alone_per_s:.1f}, beside a heavy job holding its share {attacked_per_s:.1f}; "
          f"held at most {max(h for _, _, h in samples)} bytes")
    assert attacked_per_s >= max(2.0, alone_per_s / 4), (alone_per_s, attacked_per_s, samples)
    # The pool (the limit) plus one floor batch per job: the heavy and the honest job.
    assert max(h for _, _, h in samples) <= HELD_LIMIT_BYTES + 2 * heavy_batch_bytes, samples


def test_rendezvous_waits_with_many_keys(server, observer, honest):
    attack = ATTACKS["rendezvous_waits"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S)
    print(f"rendezvous waits: {watch.summary()}; attack {dict(attack.counts)}")
    assert attack.counts["INVALID_ARGUMENT"] > 0 and attack.counts["joined"] >= 1, (attack.counts, attack.details)
    # Refused by their size, before they are parsed: 8 keys and two values of 64 KiB at most.
    assert "Rendezvous request of" in attack.details["INVALID_ARGUMENT"], attack.details
    assert "8 keys" in attack.details["INVALID_ARGUMENT"], attack.details


def test_cross_tokenizer_joins_over_the_cap_are_refused_before_their_vocabulary_is_read(server, observer, honest,
                                                                                       cross_student):
    attack = ATTACKS["vocabulary_joins_at_the_cap"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S, cross=cross_student)
    print(f"joins at the cap: {watch.summary()}; {watch.cross.summary()}; attack {dict(attack.counts)}")
    check_cross(watch, cross_student)
    # Refused joins in SHORT_S: over 100 in earlier runs, 86 in one fresh clone's run on 2 cores (each
    # sends 32,000 vocabulary entries); more than the 24 sent at once shows they were sent again.
    assert attack.counts["held"] >= 1 and attack.counts["RESOURCE_EXHAUSTED"] > 24, attack.counts
    assert "job 'attacker' already has 3 sessions" in attack.details["RESOURCE_EXHAUSTED"], attack.details


def test_cross_tokenizer_joins_matching_nothing_wait_behind_their_own_job(server, observer, honest, cross_student):
    attack = ATTACKS["vocabulary_joins_matching_nothing"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S, cross=cross_student)
    print(f"joins matching nothing: {watch.summary()}; {watch.cross.summary()}; attack {dict(attack.counts)}")
    check_cross(watch, cross_student)
    assert attack.counts["FAILED_PRECONDITION"] > 0, (attack.counts, attack.details)
    assert "no piece of the student's vocabulary" in attack.details["FAILED_PRECONDITION"], attack.details


def test_cross_tokenizer_batches_refused_once_retokenized_wait_behind_their_own_job(server, observer, honest,
                                                                                    cross_student):
    attack = ATTACKS["cross_batches_refused_once_retokenized"](server)
    watch = under_attack(attack, observer, server, honest, SHORT_S, cross=cross_student)
    print(f"cross batches refused: {watch.summary()}; {watch.cross.summary()}; attack {dict(attack.counts)}")
    check_cross(watch, cross_student)
    assert attack.counts["RESOURCE_EXHAUSTED"] > 0, (attack.counts, attack.details)
    assert "tokens in the teacher's tokenizer (rows are padded to the longest), more than the teacher's " \
        "--max-batch-tokens 2048" in attack.details["RESOURCE_EXHAUSTED"], attack.details


def test_hostile_data_plane_peers_end_only_their_own_session(server, observer, honest):
    """Every message of the handshake and the data plane, wrong (tests/hostile_peer.py): the
    teacher lives, ends that session only, and its transport processes are gone with them."""
    attack = HostilePeers(server.address, ATTACKER, "attacker", repeat=False)
    sent_before = honest_batches_sent(server, honest)
    with observer.watch() as watch, attack:
        wait_until(lambda: len(attack.results) == len(MODES), 240, "every hostile mode to finish")
    assert server.proc.poll() is None, "the teacher died"
    for result in attack.results:
        assert result["ended"] and HOSTILE_ENDINGS[result["mode"]] in result["ended"], result
    assert watch.healthz_fraction >= 0.95 and watch.get_info_p99_s < 1.0, watch.summary()
    assert honest_batches_sent(server, honest) > sent_before, "the honest session was not served"
    # One transport process per live session: none left of the attacker's.
    wait_until(lambda: transport_processes(server.proc.pid) == live_sessions(server), 10,
               "the hostile sessions' processes to go")


def test_control_characters_in_client_strings_are_refused_at_join(server):
    with grpc.insecure_channel(server.address) as channel:
        join = channel.unary_unary("/teacher.v1.TeacherService/Join",
                                   request_serializer=pb.JoinRequest.SerializeToString,
                                   response_deserializer=pb.JoinResponse.FromString)
        for job_id, peer_uuid in (("ok\n2026-12-03 INFO session forged joined", ""), ("fine", "GPU-\x1b[2J")):
            peer = pb.PeerInfo(device_type="cpu", torch_version=torch.__version__, device_uuid=peer_uuid)
            with pytest.raises(grpc.RpcError) as info:
                join(pb.JoinRequest(job_id=job_id, outputs=pb.OutputSpec(logits=True), peer=peer),
                     metadata=bearer(OPERATOR), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "control character" in info.value.details()
    assert "forged" not in server.log


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(ATTACKS))
def test_five_rounds_of_each_attack_for_a_minute(server, observer, honest, cross_student, kind):
    """Five rounds of 12 s: the bounds hold throughout, and after each round the teacher's RSS
    comes back within 100 MB of where it started, no higher after the fifth than the first."""
    pid = server.proc.pid
    start_mib = rss_mib(pid)
    after_mib = []
    for round_ in range(5):
        attack = ATTACKS[kind](server)
        cross = cross_student if kind in CHARGED else None
        watch = under_attack(attack, observer, server, honest, 12.0, cross=cross)
        if cross is not None:
            print(watch.cross.summary())
            check_cross(watch, cross)
        deadline = time.monotonic() + 20  # closed connections and ended sessions give their memory back
        while rss_mib(pid) > start_mib + 50 and time.monotonic() < deadline:
            time.sleep(0.5)
        after_mib.append(rss_mib(pid))
        print(f"{kind} round {round_ + 1}: {watch.summary()}; RSS after {after_mib[-1]:.0f} MiB "
              f"(start {start_mib:.0f}); attack {dict(attack.counts)}")
        assert after_mib[-1] <= start_mib + 100, after_mib
        # The attacker's sessions ended with their transport processes: one per live session is left.
        wait_until(lambda: transport_processes(pid) == live_sessions(server), 30,
                   "the attacker's transport processes to go")
    assert after_mib[-1] <= after_mib[0] + 30, f"RSS grew round after round: {after_mib}"
