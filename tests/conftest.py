"""Shared pytest fixtures: tiny random HF checkpoints, cached on disk, and their HF torch models.

`tiny_checkpoint(family)` is `benchmarks.tiny_checkpoints.build_cached_checkpoint(family)`: each
family of `models.random_checkpoint` built once and kept under `<repo>/.cache/tiny_checkpoints/`,
keyed by a hash of the builder's source, the family spec and the library versions.

`hf_model(family)` is the HF transformers model of that checkpoint in float32 eval mode: the
independent reference our JAX models are compared against.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

# Before torch (or any OpenMP runtime) is imported: 2 threads that sleep instead of spinning,
# since the test machine's cores are shared (busy-waiting threads made step times bimodal).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Let the TPU topology lookup (real Mosaic AOT compiles on CPU) work while another JAX process
# on the machine, e.g. a running server, holds libtpu's lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One XLA compilation cache for the child processes the tests start (engine processes, P/D and
# multi-host servers, the 8-device subprocesses): they build engines of the same few shapes again
# and again, and a hit skips XLA's compile (tracing and lowering still run). Set after JAX is
# imported here, so this process does not use it: serializing some interpret-mode Pallas
# executables into the cache crashed this process once (a segfault in jax's
# `put_executable_and_time`), and a crash here ends the whole run. Kept under the repository's
# .cache, so a local rerun is warm; CI's clean clone starts cold.
# JAXSERVE_TEST_COMPILE_CACHE=0 turns it off (to time the suite as it was).
import jax  # read this process's JAX config before the variables below exist

if os.environ.get("JAXSERVE_TEST_COMPILE_CACHE", "1") != "0":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "xla-tests")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest

from benchmarks.tiny_checkpoints import CHECKPOINT_CACHE, build_cached_checkpoint, checkpoint_cache_key  # noqa: F401 (tests' import)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """After each test module: drop JAX's caches of compiled programs and collect them.

    XLA:CPU maps about four memory regions per loaded executable and frees them only when the
    executable is collected. The default run compiles well over ten thousand programs in this one
    process, which reached Linux's `vm.max_map_count` (65530) near the end of the run: an mmap in
    LLVM's JIT failed and the process died with a SIGSEGV inside XLA's compile (seen three times in
    tests/test_ssd_kernel.py, the last module to compile much). Engines and fixtures that a module
    still holds keep their executables; only programs nothing references are freed.
    """
    yield
    jax.clear_caches()
    gc.collect()


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


# The slowest modules of the default run (benchmarks/results/cpu-2core-tests/default-run-xdist.txt),
# slowest first. They are collected first, so the two xdist workers (`--dist loadfile` hands out
# whole modules in collection order) start on them and finish on short ones instead of one worker
# running a long module alone at the end. Order inside a module is unchanged.
SLOW_MODULES_FIRST = (
    "test_disagg.py",
    "test_gguf.py",
    "test_engine_hf.py",
    "test_gpt_oss.py",
    "test_kernels_engine_pallas.py",
    "test_multiprocess.py",
    "test_agent_default_model.py",
    "test_models_hf.py",
    "test_gemma3.py",
    "test_nemotron_h.py",  # not in that run (added after it): ~5 min alone on this machine
    "test_kimi_linear.py",  # not in that run either: ~1 min alone here (the rest is -m slow)
    "test_kv_transfer.py",
    "test_pd_mla.py",  # not in that run: ~1 min alone on this machine
    "test_server_engine.py",
    "test_engine_process.py",
    "test_sharding.py",
    "test_expert_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
