"""The engine behind `jaxserve serve` (`server.cli` imports it only to serve a real engine): the loop on the transport the config picks.

    client = create_engine_client(launch_config)   # an EngineClient (server/engine_client.py)

In a child process (`EngineProcessClient`, the default), on a thread of the server's process
(`AsyncEngine`: multi-host and P/D roles, `server.engine_process: false`), or, on processes
1..N-1 of a multi-host launch, a `Follower` that serves no HTTP.
"""

from __future__ import annotations

from pathlib import Path

from models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from runtime.engine.loading import load_engine
from runtime.engine.process_client import EngineProcessClient
from runtime.engine.thread_client import AsyncEngine
from runtime.parallel.multihost import Follower, LeaderChannel, MultihostLeader


def create_engine_client(config):
    """The real engine behind `jaxserve serve`: loads the model (the default one when no path is
    given), compiles its buckets, starts the loop: in a child process (`server.engine_process`,
    runtime/engine/process_client.py) or on a thread of this process (`AsyncEngine`; always for
    multi-host and P/D roles)."""
    path = config.model.path
    if path is None:
        path, name = str(ensure_default_model()), DEFAULT_MODEL_NAME
    else:
        name = Path(path).name
    served_name = config.model.served_model_name or name
    multihost = config.parallel.multihost
    multi_process = multihost is not None and multihost.num_processes > 1
    if config.server.engine_process and not multi_process and config.parallel.role == "both":
        return EngineProcessClient.start(config, str(path), served_name)
    if not multi_process:
        return AsyncEngine(load_engine(config, str(path)), served_name)
    # multi-host (runtime/parallel/multihost.py): process 0 builds its engine with its executables
    # wrapped to broadcast every step; the followers join after the collective load
    if multihost.process_id != 0:
        return Follower(load_engine(config, str(path)), multihost)  # server/runner.serve runs its `follow()`, no HTTP
    channel = LeaderChannel()
    engine = load_engine(config, str(path), wrap_executables=channel.wrap)
    channel.connect(MultihostLeader.listen(multihost))
    client = AsyncEngine(engine, served_name)
    channel.serve(client)
    return client
