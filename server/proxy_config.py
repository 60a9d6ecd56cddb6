"""`jaxserve proxy`'s command line and the checks it must pass before the proxy starts.

The config is one frozen dataclass. The kv transfer token comes from `--kv-transfer-token` or,
preferably, JAXSERVE_KV_TRANSFER_TOKEN (read through configs/environment.py) and must pass the
instances' own rule (configs/schema.py's KVTransferSection). A proxy bound to anything but a
loopback address refuses to start without a token unless `--insecure-kv-transfer` says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import ValidationError

from configs.environment import lookup
from configs.schema import KVTransferSection
from server.deployment import is_loopback


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    kv_transfer_token: str | None = field(default=None, repr=False)
    insecure_kv_transfer: bool = False
    connect_timeout_s: float = 10.0  # TCP connect to a backend
    idle_timeout_s: float = 600.0  # longest silence while reading an answer (a stream's, or a whole JSON's)
    prefill_timeout_s: float = 120.0  # the whole prefill leg; past it, decode prefills locally
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # failed checks in a row that take a backend out
    log_level: str = "INFO"
    # the router's choice of prefill instance (server/router_pd.py): least_load is the proxy's own rule
    policy: str = "least_load"
    tokenizer: str | None = None
    block_size: int = 16
    index_blocks: int = 65536
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5


class ProxyConfigError(ValueError):
    """A command line the proxy refuses to start with (exit code 2)."""


def insecure_bind(config: ProxyConfig) -> bool:
    return not config.kv_transfer_token and not is_loopback(config.host)


def check_bind(config: ProxyConfig) -> None:
    """Refuse a non-loopback address without a kv transfer token, unless told it is on purpose."""
    if insecure_bind(config) and not config.insecure_kv_transfer:
        raise ProxyConfigError(
            f"refusing to serve on {config.host!r} (not a loopback address) without a kv transfer token. Set "
            "JAXSERVE_KV_TRANSFER_TOKEN (or --kv-transfer-token) to the same secret on the proxy, the prefill and "
            "the decode instances, e.g. `export JAXSERVE_KV_TRANSFER_TOKEN=$(python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')`; or pass --insecure-kv-transfer to run without one "
            "(not for production)"
        )


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    defaults = ProxyConfig((), ())
    parser = argparse.ArgumentParser(prog="jaxserve proxy", description="route requests prefill -> decode")
    add = parser.add_argument
    add("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances")
    add("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    add("--host", default=defaults.host, help="bind address (non-loopback needs a kv transfer token)")
    add("--port", type=int, default=defaults.port)
    add("--api-key", default=None, help="require this bearer token (forwarded to the instances)")
    add(
        "--kv-transfer-token",
        default=None,
        metavar="TOKEN",
        help="the proxy <-> instance credential, >= 16 characters (prefer JAXSERVE_KV_TRANSFER_TOKEN: flags show "
        "in ps)",
    )
    add(
        "--insecure-kv-transfer",
        action="store_true",
        help="serve on a non-loopback address without a kv transfer token (not for production)",
    )
    for flag, dest, kind, help_text in (
        ("--connect-timeout", "connect_timeout_s", float, "seconds to connect to an instance"),
        ("--idle-timeout", "idle_timeout_s", float, "seconds an instance may stay silent mid-answer"),
        ("--prefill-timeout", "prefill_timeout_s", float, "seconds for the whole prefill leg (past it: local prefill)"),
        ("--health-interval", "health_interval_s", float, "seconds between /health checks of each instance"),
        ("--health-timeout", "health_timeout_s", float, "seconds one /health check may take"),
        ("--health-failures", "health_failures", int, "failed checks in a row that take an instance out"),
    ):
        add(
            flag,
            dest=dest,
            type=_positive(kind),
            default=getattr(defaults, dest),
            metavar="N" if kind is int else "S",
            help=f"{help_text} (%(default)s)",
        )
    add("--log-level", default=defaults.log_level)
    add_policy_flags(parser, defaults)
    return parser


def add_policy_flags(parser: argparse.ArgumentParser, defaults: ProxyConfig) -> None:
    """How the prefill instance is chosen (the router's policies, server/router_policy.py)."""
    add = parser.add_argument
    add("--policy", default=defaults.policy, choices=("least_load", "cache_aware"), help="prefill choice (%(default)s)")
    add("--tokenizer", default=None, metavar="PATH", help="cache_aware: tokenizer directory (default: /tokenize)")
    for flag, dest, kind in (
        ("--block-size", "block_size", int),
        ("--index-blocks", "index_blocks", int),
        ("--cache-threshold", "cache_threshold", float),
        ("--balance-abs", "balance_abs", int),
        ("--balance-rel", "balance_rel", float),
    ):
        add(flag, dest=dest, type=_positive(kind), default=getattr(defaults, dest), help="as `jaxserve router`'s")


def build_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> ProxyConfig:
    """The proxy's config from its command line and the environment; raises ProxyConfigError."""
    args = vars(_parser().parse_args(argv))
    args["kv_transfer_token"] = args["kv_transfer_token"] or lookup("kv_transfer.token", environ)
    try:  # the instances' rule for the token, from the one schema
        KVTransferSection(token=args["kv_transfer_token"])
    except ValidationError as err:
        raise ProxyConfigError(
            f"kv transfer token (--kv-transfer-token / JAXSERVE_KV_TRANSFER_TOKEN): {err.errors()[0]['msg']}"
        ) from None
    config = ProxyConfig(prefill=tuple(args.pop("prefill")), decode=tuple(args.pop("decode")), **args)
    check_bind(config)
    return config
