"""The project's one registry mechanism: name -> factory, imported lazily, open to plugins.

    KV_CONNECTORS = Registry("kv_connector")
    KV_CONNECTORS.register("jax_transfer", "runtime.kv_transfer.jax_transfer:JaxTransferConnector")
    connector = KV_CONNECTORS.create("jax_transfer", config)   # imports the module only now

A target is a `"module:attribute"` string (imported on first use, so a registry costs nothing
until an entry is picked) or the callable itself. Installed packages add entries through
`importlib.metadata` entry points in the group `jaxserve.plugins`, named `<kind>.<name>`:

    [project.entry-points."jaxserve.plugins"]
    "kv_connector.shm" = "my_pkg.shm:SharedMemoryConnector"

An unknown name raises `KeyError` listing the known ones (built-in and installed). Plain Python,
no JAX. It lives in `models/` (the lowest layer that needs it: `models.ops` keeps the attention
and GDN back-ends here) and `runtime.registry` re-exports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Any, Generic, TypeVar

PLUGIN_GROUP = "jaxserve.plugins"

T = TypeVar("T")


def _import_target(target: str) -> Callable[..., Any]:
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"registry target must be 'module:attribute', got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Factories of one kind (`kv_connector`, `scheduling_policy`, ...) keyed by name."""

    def __init__(self, kind: str):
        if not kind.isidentifier():
            raise ValueError(f"registry kind must be an identifier, got {kind!r}")
        self.kind = kind
        self._targets: dict[str, str | Callable[..., T]] = {}

    def register(self, name: str, target: str | Callable[..., T]) -> None:
        """Add `name`; re-registering a name replaces it (tests, plugins overriding a default)."""
        if not name:
            raise ValueError(f"{self.kind}: an entry needs a non-empty name")
        if isinstance(target, str):
            module_name, sep, attribute = target.partition(":")
            if not (sep and module_name and attribute):
                raise ValueError(f"{self.kind} {name!r}: target must be 'module:attribute', got {target!r}")
        self._targets[name] = target

    def _plugin_targets(self) -> dict[str, str]:
        prefix = self.kind + "."
        return {
            ep.name[len(prefix) :]: ep.value
            for ep in metadata.entry_points(group=PLUGIN_GROUP)
            if ep.name.startswith(prefix)
        }

    def __contains__(self, name: str) -> bool:
        return name in self._targets or name in self._plugin_targets()

    def names(self) -> list[str]:
        """Every name this registry resolves: built-in entries and installed plugins."""
        return sorted(set(self._targets) | set(self._plugin_targets()))

    def get(self, name: str) -> Callable[..., T]:
        """The factory for `name`, importing its module now; KeyError naming the known entries."""
        target = self._targets.get(name)
        if target is None:
            target = self._plugin_targets().get(name)
        if target is None:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known: {self.names()} "
                f"(plugins add entries to the {PLUGIN_GROUP!r} entry-point group as "
                f"'{self.kind}.<name>')"
            )
        if isinstance(target, str):
            target = _import_target(target)
            self._targets[name] = target
        return target

    def create(self, name: str, *args: Any, **kwargs: Any) -> T:
        return self.get(name)(*args, **kwargs)
