"""Shared pytest fixtures: tiny random HF checkpoints, cached on disk, and their HF torch models.

`tiny_checkpoint(family)` builds each family of `models.random_checkpoint` once and keeps it
under `<repo>/.cache/tiny_checkpoints/<family>-<key>`, where the key hashes the builder's
source, the family spec and the library versions, so a changed builder rebuilds and an
unchanged one is reused across pytest runs. Concurrent builders are safe: each builds in its
own temporary directory and renames it into place atomically; a loser discards its copy.

`hf_model(family)` is the HF transformers model of that checkpoint in float32 eval mode: the
independent reference our JAX models are compared against.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before torch (or any OpenMP runtime) is imported: 2 threads that sleep instead of spinning,
# since the test machine's cores are shared (busy-waiting threads made step times bimodal).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Let the TPU topology lookup (real Mosaic AOT compiles on CPU) work while another JAX process
# on the machine, e.g. a running server, holds libtpu's lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_CACHE = REPO_ROOT / ".cache" / "tiny_checkpoints"


def _library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "tokenizers", "safetensors")}


def checkpoint_cache_key(family: str) -> str:
    """Hash of what determines the checkpoint's bytes: builder source, spec, Python, libraries."""
    from models import random_checkpoint

    spec = {
        "family": family,
        "describe": random_checkpoint.describe(family),
        "python": sys.version,
        "versions": _library_versions(),
    }
    digest = hashlib.sha256(Path(random_checkpoint.__file__).read_bytes())
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


def _limit_torch_threads():
    import torch

    torch.set_num_threads(2)
    return torch


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """Factory: `tiny_checkpoint(family) -> Path` of the cached tiny HF checkpoint."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            _limit_torch_threads()
            built[family] = build_cached_checkpoint(family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    """Factory: `hf_model(family)` -> the HF torch model of `tiny_checkpoint(family)`, float32,
    eval mode, loaded once per session (treat it as read-only)."""
    loaded = {}

    def get(family: str):
        if family not in loaded:
            torch = _limit_torch_threads()
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
            loaded[family] = model.eval()
        return loaded[family]

    return get
