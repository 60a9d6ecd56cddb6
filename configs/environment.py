"""The `JAXSERVE_*` environment variables that fill launch-config keys: one table, read here.

Secrets belong in the environment rather than in a YAML file or on a command line (where `ps`
shows them). Precedence: the YAML file < these variables < CLI flags (`--set`, the flag table).
A variable whose section is absent from the config (e.g. the multi-host secret on a one-process
launch) is ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# variable -> the config key it fills
ENVIRONMENT: dict[str, str] = {
    "JAXSERVE_KV_TRANSFER_TOKEN": "kv_transfer.token",  # P/D: the proxy <-> instance credential
    "JAXSERVE_MULTIHOST_SECRET": "parallel.multihost.secret",  # multi-host: the step channel's HMAC key
}
# Sections that exist whether or not the YAML names them (a variable under an optional section,
# such as parallel.multihost, only applies when that section is configured).
_ALWAYS_PRESENT = ("kv_transfer",)


def lookup(key: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value the environment gives config key `key` (None: unset or empty)."""
    environ = os.environ if environ is None else environ
    for name, target in ENVIRONMENT.items():
        if target == key and environ.get(name):
            return environ[name]
    return None


def environment_overrides(raw: Mapping, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Config key -> value for every variable set whose section `raw` configures."""
    environ = os.environ if environ is None else environ
    overrides = {}
    for name, key in ENVIRONMENT.items():
        if not environ.get(name):
            continue
        section, node = key.rpartition(".")[0], raw
        for part in section.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) or section in _ALWAYS_PRESENT:
            overrides[key] = environ[name]
    return overrides
