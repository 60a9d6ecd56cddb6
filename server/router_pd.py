"""The router's P/D mode: `jaxserve router --prefill URL ... --decode URL ...` (= `jaxserve proxy`).

The two-leg protocol, the internal token and every failure rule are the proxy's
(server/proxy.py); this mode only changes which prefill instance a request goes to. With
`--policy cache_aware` the prompt's block hashes pick the prefill instance that prefilled its
prefix most recently (the prefill side is where a prefix cache saves work), with the router's
load override; the next instances in line stay the proxy's fallbacks. `least_load` (the default)
is the proxy's own rule, unchanged. Affinity-routed prefill legs are counted in /metrics
(`jaxserve_proxy_prefill_by_affinity_total`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys

from server.proxy import Proxy
from server.proxy_config import ProxyConfig, ProxyConfigError, build_config
from server.router_policy import BlockIndex, Candidate, block_hashes, make_policy
from server.router_tokens import BackendTokenizer, LocalTokenizer, prompt_tokens

log = logging.getLogger("jaxserve.proxy")
_HASHES: contextvars.ContextVar[tuple[bytes, ...]] = contextvars.ContextVar("prefill_hashes", default=())
TOKENIZE_TIMEOUT_S = 2.0
MAX_PROMPT_CHARS = 2_000_000


class _Ordered:
    """A pool whose candidates come in the policy's order (the rest of the Pool as is)."""

    def __init__(self, pool, ordered):
        self._pool, self._ordered = pool, ordered

    def candidates(self):
        return self._ordered

    def __getattr__(self, name):
        return getattr(self._pool, name)


class PDRouter(Proxy):
    def __init__(self, config: ProxyConfig, tokenizer=None, **kwargs):
        super().__init__(config, **kwargs)
        self.index = BlockIndex(config.index_blocks)
        self.policy = make_policy(
            config.policy, self.index, config.cache_threshold, config.balance_abs, config.balance_rel
        )
        self.tokenizer = tokenizer or BackendTokenizer()
        self.counters["prefill_by_affinity"] = 0

    async def _prefill(self, path: str, body: dict, headers: dict):
        if self.config.policy != "cache_aware":
            return await super()._prefill(path, body, headers)
        urls = [b.url for b in self.prefill.candidates()]
        tokens = await prompt_tokens(
            self.tokenizer, path, body, self.session, urls, TOKENIZE_TIMEOUT_S, MAX_PROMPT_CHARS, headers
        )
        reset = _HASHES.set(tuple(block_hashes(tokens, self.config.block_size)) if tokens else ())
        try:
            return await super()._prefill(path, body, headers)
        finally:
            _HASHES.reset(reset)

    def _post(self, pool, path, body, headers, timeout):
        hashes = _HASHES.get()
        if pool is self.prefill and hashes:
            pool = self._ordered(pool, hashes)
        return super()._post(pool, path, body, headers, timeout)

    def _ordered(self, pool, hashes: tuple[bytes, ...]) -> _Ordered:
        backends = pool.candidates()  # least outstanding first
        decision = self.policy.choose([Candidate(b.index, b.outstanding) for b in backends], hashes)
        chosen = next(b for b in backends if b.index == decision.backend_id)
        self.index.insert(chosen.index, hashes)
        self.counters["prefill_by_affinity"] += decision.by_affinity
        return _Ordered(pool, [chosen, *(b for b in backends if b is not chosen)])


def main(argv: list[str]) -> int:
    """`jaxserve proxy ...` and `jaxserve router --prefill ... --decode ...`."""
    from server.proxy import _serve

    try:
        config = build_config(argv)
    except ProxyConfigError as err:
        print(f"jaxserve proxy: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else None
    except (OSError, ValueError) as err:
        print(f"jaxserve proxy: --tokenizer {config.tokenizer}: {err}", file=sys.stderr)
        return 2
    asyncio.run(_serve(PDRouter(config, tokenizer)))
    return 0
