"""Every `JAXSERVE_*` environment variable the product reads, read here and nowhere else.

Two kinds. `ENVIRONMENT` fills launch-config keys: secrets belong in the environment rather than
in a YAML file or on a command line (where `ps` shows them). Precedence: the YAML file < these
variables < CLI flags (`--set`, the flag table); a variable whose section is absent from the
config (e.g. the multi-host secret on a one-process launch) is ignored. `SETTINGS` are
process-level switches and paths outside the launch config (caches, the native CPU kernels, a
test hook), each read through its accessor below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# variable -> the config key it fills
ENVIRONMENT: dict[str, str] = {
    "JAXSERVE_KV_TRANSFER_TOKEN": "kv_transfer.token",  # P/D: the proxy <-> instance credential
    "JAXSERVE_MULTIHOST_SECRET": "parallel.multihost.secret",  # multi-host: the step channel's HMAC key
}
# Process-level settings (not launch keys): variable -> what it does.
SETTINGS: dict[str, str] = {
    "JAXSERVE_CACHE_DIR": "where downloaded models are cached (default ~/.cache/jaxserve)",
    "JAXSERVE_NATIVE": "0 turns the native CPU kernels off (pallas_kernels/cpu_native.py)",
    "JAXSERVE_NATIVE_CACHE": "where the native CPU kernels are built (default $XDG_CACHE_HOME/jaxserve/native)",
    "JAXSERVE_TEST_KV_PULL_DELAY_S": "test hook: seconds a decode instance waits between a claim and its pull",
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


def model_cache_dir() -> str | None:
    return os.environ.get("JAXSERVE_CACHE_DIR") or None


def native_kernels_enabled() -> bool:
    return os.environ.get("JAXSERVE_NATIVE", "1") != "0"


def native_cache_dir() -> str | None:
    return os.environ.get("JAXSERVE_NATIVE_CACHE") or None


def test_kv_pull_delay_s() -> float:
    return float(os.environ.get("JAXSERVE_TEST_KV_PULL_DELAY_S") or 0)
