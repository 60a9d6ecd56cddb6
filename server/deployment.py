"""Start-up checks of what a process exposes: a P/D role or proxy on a non-loopback address needs
the internal token, and a wildcard bind needs an address to advertise. Plain Python, no JAX.

Loopback-only deployments (one machine: the CPU bench, tests) may run without a token; their
trust boundary is the machine. Anything reachable from the network fails closed unless the
operator says `--insecure-kv-transfer`, which is then logged as a warning every minute.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

log = logging.getLogger("jaxserve.deployment")
WILDCARDS = ("0.0.0.0", "::", "")
INSECURE_WARNING_PERIOD_S = 60.0
HOW_TO_SET_TOKEN = (
    "set the internal token on every instance and the proxy: export JAXSERVE_KV_TRANSFER_TOKEN="
    "$(python -c 'import secrets; print(secrets.token_urlsafe(32))') (or --kv-transfer-token, or "
    "kv_transfer.token in the YAML); --insecure-kv-transfer serves without one (not for production)"
)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for wildcards and every other address."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it is reachable from elsewhere


def pd_deployment_error(config) -> str | None:
    """Why a `LaunchConfig` with a P/D role must not start, or None."""
    if config.parallel.role == "both":
        return None
    kv = config.kv_transfer
    if kv.host.strip() in WILDCARDS and not kv.advertise_host and config.parallel.role == "prefill":
        return (
            f"kv_transfer.host {kv.host!r} binds every interface: set kv_transfer.advertise_host to the address "
            "decode instances dial (e.g. --set kv_transfer.advertise_host=10.0.0.5)"
        )
    exposed = [
        f"{name} {host!r}"
        for name, host in (("server.host", config.server.host), ("kv_transfer.host", kv.host))
        if not is_loopback(host)
    ]
    if exposed and kv.token is None and not kv.insecure:
        return (
            f"role {config.parallel.role} binds a non-loopback address ({', '.join(exposed)}) without "
            f"kv_transfer.token: {HOW_TO_SET_TOKEN}"
        )
    return None


def warn_insecure_every_minute(what: str, stop: threading.Event | None = None) -> threading.Event:
    """Log that `what` runs without its credential, now and every minute (a daemon thread)."""
    stop = stop or threading.Event()

    def loop():
        while True:
            log.warning(
                "INSECURE: %s runs on a non-loopback address without kv_transfer.token "
                "(--insecure-kv-transfer); anyone who reaches it can inject or read KV state",
                what,
            )
            if stop.wait(INSECURE_WARNING_PERIOD_S):
                return

    threading.Thread(target=loop, name="jaxserve-insecure-warning", daemon=True).start()
    return stop
