"""From a validated launch config to a loaded, compiled `LLMEngine`, in whichever process runs the loop.

    engine = load_engine(launch_config, "/path/to/hf_dir")   # the thread's process or the engine process

`engine_config_from_launch` maps the launch config onto `EngineConfig` (after starting
`jax.distributed` for a multi-host launch). The engine process builds its engine with
`load_engine` (runtime/engine/process_client.py), and so does runtime/engine/client_factory.py for
the thread and multi-host clients.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import EngineConfig, build_engine_config
from runtime.parallel.mesh import initialize_multihost

log = logging.getLogger("jaxserve.engine")


def engine_config_from_launch(config, model_path: str) -> EngineConfig:
    """Map the validated YAML launch config onto the engine's config (`build_engine_config`, the
    one mapping), after starting `jax.distributed` for a multi-host launch.

    `parallel`: `role` prefill / decode (with the `kv_transfer` section) sets up disaggregation;
    `multihost` starts `jax.distributed` (so call this before any other JAX work); `mesh` becomes
    `mesh_shape` when it spans more than one device."""
    parallel = config.parallel
    if parallel.multihost is not None and parallel.multihost.num_processes > 1 and parallel.role != "both":
        raise ValueError(
            "multi-process serving (parallel.multihost) runs role: both only; "
            "P/D disaggregation across processes of one mesh is not built"
        )
    initialize_multihost(parallel)
    # serving compiles every executable a step can ask for at start-up (compile.aot), then seals
    return build_engine_config(config, model_path, aot_compile_all=config.compile.aot)


def load_engine(config, model_path: str, wrap_executables=None) -> LLMEngine:
    """Load the launch config's model and compile its steps (in the server's process for the
    thread, in the engine process otherwise), logging what it got. `wrap_executables`: the
    multi-host leader's (`LeaderChannel.wrap`)."""
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config_from_launch(config, model_path), progress=True, wrap_executables=wrap_executables)
    log.info(
        "engine ready in %.1fs: %s, %d KV pages of %d tokens, buckets %s",
        time.perf_counter() - t0,
        Path(model_path).name,
        engine.cache_config.num_pages,
        engine.config.page_size,
        list(engine.token_buckets),
    )
    return engine
