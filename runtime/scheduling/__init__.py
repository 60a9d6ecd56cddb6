"""Scheduling, plain Python (no JAX): a request's state, the continuous-batching scheduler, its
policies and attention data parallelism's per-rank scheduler."""
