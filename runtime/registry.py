"""The project's one registry mechanism (`models.registry`), re-exported for the runtime's users
(connectors, scheduling policies, plugins): `Registry`, `PLUGIN_GROUP`."""

from models.registry import PLUGIN_GROUP, Registry

__all__ = ["PLUGIN_GROUP", "Registry"]
