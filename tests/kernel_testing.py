"""How kernel tests run a GPU Pallas kernel: compiled where a GPU is present (the device check),
under the Pallas interpreter everywhere else. Same cases, same tolerances, either way."""

import jax


def gpu_kernel_interpret() -> bool:
    """`interpret=` for a `pallas_gpu` kernel: False on a GPU backend, else True."""
    return jax.default_backend() != "gpu"
