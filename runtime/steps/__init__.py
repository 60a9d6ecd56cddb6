"""Compiled steps: the executables of one engine and their inputs (the request table, the host batch,
sampling metadata), the sampler, the in-flight step of asynchronous scheduling, the execution plan."""
