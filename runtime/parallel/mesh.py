"""The device mesh of one engine and multi-host start-up, from the launch config's `parallel` section.

    initialize_multihost(config.parallel)   # before any other JAX call, on every host
    mesh = make_mesh(data=2, model=4)       # axes ("data", "model"), both AxisType.Auto

The `model` axis carries tensor parallelism (models/sharding.py); the `data` axis carries
attention data parallelism (runtime/parallel/data_parallel.py): weights are replicated over it, each rank
serves its own batch from its own pages and state slots. Axes are Auto (GSPMD) because `jax.make_mesh` now defaults to
Explicit axes, under which a row-parallel matmul raises `ShardingTypeError`.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

log = logging.getLogger("jaxserve.mesh")

DATA_AXIS, MODEL_AXIS = "data", "model"
# jax.distributed.shutdown() is a barrier over all processes; a peer that died must not hold the
# survivors for jax's default 5 minutes.
SHUTDOWN_BARRIER_S = 30


def make_mesh(data: int, model: int, devices=None) -> Mesh:
    """A (data, model) mesh over `devices` (default: every device of every process)."""
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != data * model:
        raise ValueError(
            f"parallel.mesh data={data} x model={model} needs {data * model} devices, but "
            f"{len(devices)} are visible ({devices[0].platform if devices else 'none'}); set the mesh "
            f"to the device count, or limit the visible devices"
        )
    if devices == list(jax.devices()):
        return jax.make_mesh((data, model), (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
    grid = np.array(devices, dtype=object).reshape(data, model)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def initialize_multihost(cfg) -> bool:
    """`jax.distributed.initialize` from a `ParallelConfig` (or its `multihost` section).

    Returns True when it initialised the distributed runtime, False when no multihost section
    is configured or it was already initialised. Must run before any other JAX computation.
    """
    multihost = getattr(cfg, "multihost", cfg)
    if multihost is None:
        return False
    if jax.distributed.is_initialized():
        log.info("jax.distributed is already initialised; keeping it")
        return False
    from runtime.parallel.multihost_channel import check_secret, coordinator_bind_address

    # Refused before anything listens: a launch that other machines can reach needs the secret.
    authenticated = check_secret(multihost)
    bind_address = coordinator_bind_address(multihost)
    log.info(
        "jax.distributed.initialize(%s, num_processes=%d, process_id=%d, coordinator_bind_address=%s)%s",
        multihost.coordinator_address,
        multihost.num_processes,
        multihost.process_id,
        bind_address,
        "" if authenticated or multihost.num_processes == 1 else "; no secret: loopback only",
    )
    # Cross-process collectives on the CPU backend (ignored by TPU/GPU backends).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if getattr(multihost, "cpu_devices", None):
        jax.config.update("jax_num_cpu_devices", multihost.cpu_devices)
    jax.distributed.initialize(
        coordinator_address=multihost.coordinator_address,
        num_processes=multihost.num_processes,
        process_id=multihost.process_id,
        coordinator_bind_address=bind_address,
        shutdown_timeout_seconds=SHUTDOWN_BARRIER_S,
    )
    return True
