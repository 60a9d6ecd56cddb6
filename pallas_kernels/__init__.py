"""jaxserve pallas_kernels."""
