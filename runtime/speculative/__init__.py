"""Speculative decoding: drafts proposed on the host, verified inside the compiled steps."""
