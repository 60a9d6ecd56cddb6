"""Tiny random HF checkpoints (`models.random_checkpoint`), built once and cached on disk, for the
tests (tests/conftest.py's `tiny_checkpoint` fixture) and the benchmarks that use the same shapes.

`build_cached_checkpoint(family)` keeps each family under
`<repo>/.cache/tiny_checkpoints/<family>-<key>`, where the key hashes the builder's source, the
family spec and the library versions: a changed builder rebuilds, an unchanged one is reused.
Concurrent builders are safe: each builds in its own temporary directory and renames it into
place atomically; a loser discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_CACHE = REPO_ROOT / ".cache" / "tiny_checkpoints"


def _library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "tokenizers", "safetensors")}


def checkpoint_cache_key(family: str) -> str:
    """Hash of what determines the checkpoint's bytes: builder source, spec, Python, libraries."""
    from models import random_checkpoint, random_mtp

    spec = {
        "family": family,
        "describe": random_checkpoint.describe(family),
        "python": sys.version,
        "versions": _library_versions(),
    }
    digest = hashlib.sha256(Path(random_checkpoint.__file__).read_bytes())
    digest.update(Path(random_mtp.__file__).read_bytes())  # the MTP layer of Qwen3.5 / Qwen3-Next
    digest.update(json.dumps(spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def build_cached_checkpoint(family: str, cache_root: Path = CHECKPOINT_CACHE) -> Path:
    """The tiny `family` checkpoint directory, built on first use (atomic rename into place)."""
    from models.random_checkpoint import write_random_checkpoint

    target = cache_root / f"{family}-{checkpoint_cache_key(family)}"
    if (target / "config.json").exists():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=cache_root))
    try:
        write_random_checkpoint(family, staging)
        staging.chmod(0o755)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
