"""Parallelism across devices and processes: the mesh, attention data parallelism's device side,
multi-process serving (leader and followers)."""
