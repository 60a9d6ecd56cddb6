"""Prefill/decode disaggregation: move a request's KV pages and GDN state between instances.

    KV_CONNECTORS.create(config.connector, config)   # a KVConnector (base.py), by name

`base.py` fixes the connector interface (its settings, `KVTransferConfig`, are a part of the
engine's config: runtime/engine_config.py); `descriptor.py` describes what a
prefill instance holds (and checks it on the decode side); `layout.py` gathers a request's pages
and state slot out of the caches and writes them into another engine's pages (page size, KV dtype
and TP degree may differ); `leases.py` keeps offered state until it is pulled, aborted or expired;
`control.py` is the JSON-over-HTTP control channel; `jax_transfer.py` is the default connector;
`hooks.py` is the engine's side of it all. docs/disaggregation.md tells the whole story.
"""

from runtime.engine_config import KVTransferConfig
from runtime.kv_transfer.base import KVConnector, PullResult, TransferError
from runtime.registry import Registry

KV_CONNECTORS: Registry[KVConnector] = Registry("kv_connector")
KV_CONNECTORS.register("jax_transfer", "runtime.kv_transfer.jax_transfer:JaxTransferConnector")

__all__ = ["KV_CONNECTORS", "KVConnector", "KVTransferConfig", "PullResult", "TransferError"]
