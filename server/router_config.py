"""`jaxserve router`'s command line: one frozen config, checked before the router starts.

    jaxserve router --backend URL [--backend URL ...] [--policy cache_aware|least_load|round_robin]
                    [--tokenizer PATH] [--host H --port P --api-key K]
    jaxserve router --prefill URL ... --decode URL ...      (P/D pools: `jaxserve proxy`'s mode)

The thresholds of the cache-aware policy start from SGLang's router defaults (cache threshold
0.3, balance thresholds 64 requests absolute and 1.5x relative). Every wait and size is bounded
here: connect/idle/tokenize timeouts, the request body cap and the per-backend index cap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from urllib.parse import urlsplit

POLICIES = ("cache_aware", "least_load", "round_robin")
PD_FLAGS = ("--prefill", "--decode")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    tokenizer: str | None = None  # a local tokenizer directory; None: ask a backend's /tokenize
    block_size: int = 16  # tokens per hashed block (the backends' page size)
    index_blocks: int = 65536  # block hashes remembered per backend (LRU)
    cache_threshold: float = 0.3  # matched share of the prompt's blocks that makes affinity count
    balance_abs: int = 64  # affinity is overridden when the chosen backend has this many more requests
    balance_rel: float = 1.5  # ... and this many times the least loaded one's
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_chars: int = 2_000_000  # longer prompts are routed by load alone (not tokenized)
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0  # longest silence of a backend while answering
    tokenize_timeout_s: float = 2.0  # past it, the request is routed by load alone
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_failures: int = 3  # failed checks (or requests) in a row that take a backend out
    log_level: str = "INFO"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise RouterConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for url in self.backends:
            check_url(url)
        if len(set(self.backends)) != len(self.backends):
            raise RouterConfigError("--backend: the same URL is given twice")


class RouterConfigError(ValueError):
    """A command line the router refuses to start with (exit code 2)."""


def check_url(url: str) -> str:
    """`http(s)://host:port` with no path, query or credentials; returns it without a trailing /."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RouterConfigError(f"backend URL must be http(s)://host:port, got {url!r}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username or parts.password:
        raise RouterConfigError(f"backend URL must have no path, query or credentials, got {url!r}")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as err:
        raise RouterConfigError(f"backend URL {url!r}: {err}") from None
    return url.rstrip("/")


def is_pd_mode(argv: list[str]) -> bool:
    return any(arg.split("=")[0] in PD_FLAGS for arg in argv)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    defaults = RouterConfig(())
    parser = argparse.ArgumentParser(
        prog="jaxserve router",
        description="one OpenAI endpoint in front of many jaxserve replicas (with --prefill/--decode: P/D pools, "
        "see `jaxserve proxy --help`)",
    )
    add = parser.add_argument
    add(
        "--backend", action="extend", nargs="+", required=True, metavar="URL", help="replicas (one or more, repeatable)"
    )
    add("--policy", default=defaults.policy, choices=POLICIES, help="how a replica is chosen (%(default)s)")
    add("--tokenizer", default=None, metavar="PATH", help="tokenizer directory (default: the replicas' /tokenize)")
    add("--host", default=defaults.host)
    add("--port", type=int, default=defaults.port)
    add("--api-key", default=None, help="require this bearer token (forwarded to the replicas; guards /admin)")
    for flag, dest, kind, help_text in (
        ("--block-size", "block_size", int, "tokens per hashed prompt block"),
        ("--index-blocks", "index_blocks", int, "block hashes remembered per replica"),
        ("--cache-threshold", "cache_threshold", float, "matched share of the prompt that routes by affinity"),
        ("--balance-abs", "balance_abs", int, "outstanding requests above the least loaded that void affinity"),
        ("--balance-rel", "balance_rel", float, "... and load ratio to the least loaded"),
        ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted"),
        ("--connect-timeout", "connect_timeout_s", float, "seconds to connect to a replica"),
        ("--idle-timeout", "idle_timeout_s", float, "seconds a replica may stay silent mid-answer"),
        ("--tokenize-timeout", "tokenize_timeout_s", float, "seconds to tokenize a prompt for routing"),
        ("--health-interval", "health_interval_s", float, "seconds between /health checks"),
        ("--health-timeout", "health_timeout_s", float, "seconds one /health check may take"),
        ("--health-failures", "health_failures", int, "failures in a row that take a replica out"),
    ):
        add(flag, dest=dest, type=_positive(kind), default=getattr(defaults, dest), help=f"{help_text} (%(default)s)")
    add("--log-level", default=defaults.log_level)
    return parser


def build_config(argv: list[str] | None = None) -> RouterConfig:
    """The router's config from its command line; raises RouterConfigError."""
    args = vars(_parser().parse_args(argv))
    if args["cache_threshold"] > 1:
        raise RouterConfigError(f"--cache-threshold must be in (0, 1], got {args['cache_threshold']}")
    if args["balance_rel"] < 1:
        raise RouterConfigError(f"--balance-rel must be >= 1, got {args['balance_rel']}")
    return RouterConfig(backends=tuple(check_url(u) for u in args.pop("backend")), **args)
