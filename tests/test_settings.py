"""Settings written once: each program's flags come from its dataclass fields, with their help,
defaults and checks (distill_common/settings.py). No server, no model."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from distill_common.settings import ConfigError, non_defaults, settings_from, settings_parser
from distill_demo.config import DemoConfig
from distill_demo.eagle3 import Eagle3DemoConfig
from student_trainer.config import TrainConfig
from student_trainer.eagle3.config import Eagle3Config, Eagle3EvalConfig
from teacher_server.admin import AdminConfig
from teacher_server.config import ServerConfig

PROGRAMS = [ServerConfig, TrainConfig, AdminConfig, DemoConfig, Eagle3Config, Eagle3EvalConfig, Eagle3DemoConfig]
TRAIN_REQUIRED = ["--model", "m", "--data", "d", "--teacher", "t:1"]


def parse(settings: type, *argv: str):
    return settings_from(settings, settings_parser(settings).parse_args(list(argv)))


@pytest.mark.parametrize("settings", PROGRAMS, ids=lambda s: s.__name__)
def test_every_flag_has_help_and_is_listed_once_by_its_dashed_name(settings):
    help_text = settings_parser(settings, prog="x").format_help()
    for field in dataclasses.fields(settings):
        if not field.init:
            continue
        assert field.metadata.get("help"), f"{settings.__name__}.{field.name} has no help text"
        dashed = "--" + field.name.replace("_", "-")
        assert len(re.findall(rf"^  {dashed}(?=[ ,]|$)", help_text, re.MULTILINE)) == 1, (dashed, help_text)
    assert not re.search(r"^  --\w*_", help_text, re.MULTILINE), help_text  # the underscore spelling is not shown


def test_special_flag_texts_parse_into_their_fields(monkeypatch):
    monkeypatch.setenv("TEACHER_AUTH_TOKEN", "from-env")
    server = parse(ServerConfig, "--cache-bytes", "8GiB", "--dtype", "bfloat16", "--trust-remote-code")
    assert (server.cache_bytes, server.dtype, server.trust_remote_code) == (8 << 30, "bfloat16", True)
    assert server.auth_token == "from-env" and parse(ServerConfig, "--auth-token", "flag").auth_token == "flag"
    assert parse(ServerConfig, "--cache-bytes", "2GB").cache_bytes == 2 * 10**9
    train = parse(TrainConfig, *TRAIN_REQUIRED, "--hidden-layers", "0,2", "--hidden-weight", "1")
    assert train.hidden_layers == (0, 2)
    assert parse(DemoConfig, "--seeds", "3,4,5").seeds == (3, 4, 5)
    for settings, argv in ((ServerConfig, ["--cache-bytes", "8XB"]),
                           (TrainConfig, [*TRAIN_REQUIRED, "--hidden-layers", "1,x"])):
        with pytest.raises(SystemExit):
            parse(settings, *argv)


def test_a_choice_or_check_failed_in_python_names_the_flag():
    with pytest.raises(ConfigError, match="--log-format 'xml': use one of text, json"):
        ServerConfig(log_format="xml")
    with pytest.raises(ConfigError, match="--loss 'kl': use one of forward_kl, reverse_kl, jsd"):
        TrainConfig(model="m", data="d", teacher="t:1", loss="kl")
    with pytest.raises(ConfigError, match="--max-batch-tokens"):
        ServerConfig(max_batch_tokens=10, max_seq_len=20)
    with pytest.raises(ConfigError, match="--timeout-s"):
        AdminConfig(timeout_s=0)


def test_the_default_request_limit_holds_a_join_whose_logit_subset_is_the_whole_vocabulary():
    from distill_common.outputs import SubsetLogits, output_spec
    from distill_common.proto.teacher.v1 import teacher_pb2 as pb
    from distill_common.wire import encode

    vocab = 128_256  # Llama 3's
    spec = output_spec([SubsetLogits(range(vocab))])
    spec.logit_subset.CopyFrom(encode(torch.arange(vocab)))  # int64, the widest ids the wire takes
    join_bytes = pb.JoinRequest(job_id="j" * 128, outputs=spec).ByteSize()
    config = ServerConfig(max_batch_tokens=2048)
    config.fit_model(None)
    assert config.request_limit_bytes < join_bytes  # a batch alone would not make room for it
    config.fit_model(None, vocab)
    assert config.request_limit_bytes >= join_bytes


def test_non_default_settings_are_logged_and_secrets_hidden():
    config = parse(ServerConfig, "--max-sessions", "3", "--auth-token", "s3cret")
    assert non_defaults(config) == {"max_sessions": 3, "auth_token": "(set)"}
    assert "s3cret" not in repr(config)


def test_the_eagle3_settings_take_their_teacher_connection_checks_from_the_trainers():
    """Eagle3Config and Eagle3EvalConfig run TrainConfig's checks of reconnects, resubmits, the
    log level, TLS and the FP8 teacher's bound on themselves: valid values pass, and a bad one is refused by flag."""
    valid = dict(teacher="host:1", data="d.jsonl")
    Eagle3Config(target_model="t", output_dir="o", **valid)
    Eagle3EvalConfig(draft="draft", **valid)
    for config in (lambda **kw: Eagle3Config(target_model="t", output_dir="o", **valid, **kw),
                   lambda **kw: Eagle3EvalConfig(draft="draft", **valid, **kw)):
        with pytest.raises(ConfigError, match="--teacher-max-resubmits"):
            config(teacher_max_resubmits=-1)
        with pytest.raises(ConfigError, match="--teacher-tls-cert"):
            config(teacher_tls_cert="cert.pem")  # a client certificate without its key
        with pytest.raises(ConfigError, match="--max-teacher-kl"):
            config(max_teacher_kl=-1.0)
        # An evaluation bounds the FP8 teacher it scores against as training does.
        assert config(refuse_fp8_teacher=True, max_teacher_kl=0.01).max_teacher_kl == 0.01


def test_the_default_held_outputs_take_at_most_a_quarter_of_the_memory_available():
    from distill_common.outputs import TeacherFacts
    from teacher_server.limits import available_memory_bytes

    gib = 2**30
    facts = TeacherFacts(vocab_size=128_256, hidden_size=4096, num_layers=32, dtype=torch.bfloat16)
    config = ServerConfig(max_batch_tokens=2048)
    # float32 full logits, the default --max-topk 1024 (values and ids), 33 hidden states, the next
    # token's log-probability and the default --max-score-ids 8, for each of 2048 tokens.
    batch_bytes = 2048 * 4 * (128_256 + 2 * 1024 + 33 * 4096 + 1 + 8)
    assert config.held_bytes_limit(facts, available_bytes=1024 * gib) == config.max_inflight * batch_bytes
    # A 12 GiB host, where the batches alone would take more than it has.
    assert config.max_inflight * batch_bytes > 12 * gib
    assert config.held_bytes_limit(facts, available_bytes=12 * gib) == 3 * gib
    # The operator's figure is kept, whatever the machine has.
    assert ServerConfig(max_held_bytes=40 * gib).held_bytes_limit(facts, available_bytes=24 * gib) == 40 * gib
    total_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_memory_bytes("cpu") <= total_bytes
