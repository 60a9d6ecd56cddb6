"""Benchmark scripts: offline throughput, online serving load, peers (not part of the installed package)."""
