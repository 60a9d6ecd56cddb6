"""jaxserve runtime."""
