"""The default connector: arrays move with `jax.experimental.transfer`, control over HTTP/JSON.

Prefill side: `offer` registers the gathered arrays with `TransferServer.await_pull(uuid, ...)`
and a lease bound to the prompt's digest and the checkpoint's fingerprint; the control server
(control.py; the token required when one is configured) answers claim / release. Decode side:
a worker thread claims the transfer — one-shot, and only for the prompt and model it belongs
to — from a control endpoint it may dial (configured `peers`, or any named by token-bearing
parameters), takes the transfer address from the claim's reply (never from the client's
parameters), pulls with `connect(address).pull(uuid, specs)` (device to device on TPU/GPU,
process to process on CPU), then releases it as "pulled". A pull is only started after a
successful claim because pulling a uuid nobody awaits blocks forever.

Every wait is bounded: claims and releases by `control_timeout_s`, a pull by `pull_timeout_s`
(the transfer API has no cancel: a pull past its deadline is reported failed and its thread
abandoned, no longer counted against `max_pulls_in_flight`). Bytes are capped on both sides
(`max_held_bytes`, `max_staged_bytes`).

State nobody will pull (lease expired, claimed or not; decode aborted before pulling) is drained
by pulling it from this process's own transfer server. A claimed lease may have been pulled
already (a second pull never completes): its drain is abandoned after DRAIN_TIMEOUT_S and its
bytes stop counting as held.

Test hook: `JAXSERVE_TEST_KV_PULL_DELAY_S` (environment, decode side) sleeps that long between a
successful claim and the pull, so a fault test can kill the prefill instance mid-pull.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import urllib.parse

import jax
import jax.experimental.transfer

from configs import environment
from configs.rules import normalize_peer
from runtime.engine_config import KVTransferConfig
from runtime.kv_transfer.base import KVConnector, PullResult, TransferCapacityError, TransferError
from runtime.kv_transfer.control import ControlServer, post_json
from runtime.kv_transfer.leases import ClaimRefused, Lease, LeaseTable

log = logging.getLogger("jaxserve.kv_transfer")
REAP_INTERVAL_S = 0.25
DRAIN_TIMEOUT_S = 10.0
MAX_ABANDONED_PULLS = 256  # threads stuck in a pull past its deadline; beyond this, pulls are refused


class JaxTransferConnector(KVConnector):
    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        host = config.host
        self._server = jax.experimental.transfer.start_transfer_server(
            jax.devices()[0].client, f"{host}:0", [f"{host}:0"]
        )
        self._advertise = config.advertise_host or host
        self._address = f"{self._advertise}:{self._server.address().rpartition(':')[2]}"
        self._lock = threading.Lock()
        self._connections: dict[str, object] = {}
        self._pulls: dict[str, _Pull] = {}
        self._abandoned: set[_Pull] = set()  # past their deadline, thread still blocked in the pull
        self._draining: dict[str, int] = {}  # transfer id -> bytes the transfer server still holds
        self.counters = {
            "transfers_offered": 0,
            "transfers_started": 0,
            "transfers_completed": 0,
            "transfers_failed": 0,
            "bytes_transferred": 0,
            "bytes_pulled": 0,
            "seconds_transferred": 0.0,
            "claims_refused": 0,
            "leases_drained": 0,
            "offers_refused": 0,
            "pulls_abandoned": 0,
            "peers_refused": 0,
        }
        self.leases = LeaseTable(config.lease_s)
        self._test_delay_s = environment.test_kv_pull_delay_s()
        self._control = None
        self._stop = threading.Event()
        if config.role == "prefill":
            self._control = ControlServer(
                host,
                config.control_port,
                {"/kv_transfer/claim": self._on_claim, "/kv_transfer/release": self._on_release},
                token=config.token,
            )
            threading.Thread(target=self._reap, name="jaxserve-kv-leases", daemon=True).start()

    # ---- prefill side ----------------------------------------------------------------------
    def has_room(self) -> bool:
        """Prefill side: below the held-bytes cap (checked when a request is admitted)."""
        return self.bytes_held() < self.config.max_held_bytes

    def bytes_held(self) -> int:
        with self._lock:
            draining = sum(self._draining.values())
        return self.leases.held()[3] + draining

    def offer(self, arrays: list, descriptor: dict, lease_s: float | None = None) -> dict:
        nbytes = sum(a.nbytes for a in arrays)
        if self.bytes_held() + nbytes > self.config.max_held_bytes:
            self._count("offers_refused")
            raise TransferCapacityError(
                f"offered state would exceed kv_transfer.max_held_bytes ({self.config.max_held_bytes} bytes)"
            )
        uuid = secrets.randbits(62)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
        held = descriptor["num_pages"] if any(n.startswith("kv") for n, _, _ in descriptor["arrays"]) else 0
        slots = 1 if any(n.startswith("rec") for n, _, _ in descriptor["arrays"]) else 0
        self._server.await_pull(uuid, arrays)
        self.leases.add(
            Lease(
                str(uuid),
                (arrays, specs),
                held,
                slots,
                nbytes,
                self.leases.new_deadline(lease_s),
                token_digest=descriptor["token_digest"],
                model_fingerprint=descriptor["model"]["fingerprint"],
            )
        )
        self._count("transfers_offered")
        return {
            "transfer_id": str(uuid),
            "transfer_address": self._address,
            "control_url": f"http://{self._advertise}:{self._control.port}",
            "lease_s": min(self.config.lease_s, lease_s or self.config.lease_s),
            "descriptor": descriptor,
        }

    def _on_claim(self, body: dict) -> tuple[int, dict]:
        fields = ("transfer_id", "token_digest", "model_fingerprint")
        if not all(isinstance(body.get(name), str) for name in fields):
            self._count("claims_refused")
            return 400, {"error": f"a claim names {', '.join(fields)} (strings)"}
        try:
            self.leases.claim(
                body["transfer_id"],
                self.config.pull_timeout_s,
                token_digest=body["token_digest"],
                model_fingerprint=body["model_fingerprint"],
            )
        except ClaimRefused as refused:
            self._count("claims_refused")
            log.warning("kv transfer %.20s: claim refused: %s", body["transfer_id"], refused)
            return refused.status, {"error": str(refused)}
        return 200, {"ok": True, "transfer_address": self._address}

    def _on_release(self, body: dict) -> tuple[int, dict]:
        status = body.get("status")
        if status not in ("pulled", "abort") or not isinstance(body.get("transfer_id"), str):
            return 400, {"error": "a release names transfer_id (a string) and status 'pulled' or 'abort'"}
        lease = self.leases.release(body["transfer_id"])
        if lease is None:
            return 200, {"ok": False}
        if status == "pulled" and lease.claimed:
            self._count("transfers_completed")
            self._count("bytes_transferred", lease.nbytes)
        else:  # "pulled" without a claim cannot be true: the transfer server still holds it
            self._drain(lease)
        return 200, {"ok": True}

    def _reap(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            for lease in self.leases.pop_expired():
                log.warning("kv transfer %s: lease expired; freeing its state", lease.transfer_id)
                self._drain(lease)

    def _drain(self, lease: Lease) -> None:
        """Pull the state from ourselves so the transfer server lets go of it. Its bytes count
        as held until that pull ends; a claimed lease may have been pulled by the decode side
        already (then our pull never completes): after DRAIN_TIMEOUT_S it is given up."""
        self._count("leases_drained")
        _, specs = lease.payload
        done = threading.Event()
        with self._lock:
            self._draining[lease.transfer_id] = lease.nbytes

        def pull_own():
            try:
                jax.block_until_ready(self._connect(self._server.address()).pull(int(lease.transfer_id), specs))
            except Exception:
                log.exception("draining transfer %s failed", lease.transfer_id)
            done.set()

        def watch():
            if not done.wait(DRAIN_TIMEOUT_S):
                log.info(
                    "kv transfer %s: drain gave up after %.0f s (pulled by the decode side already)",
                    lease.transfer_id,
                    DRAIN_TIMEOUT_S,
                )
            with self._lock:
                self._draining.pop(lease.transfer_id, None)

        threading.Thread(target=pull_own, name="jaxserve-kv-drain", daemon=True).start()
        threading.Thread(target=watch, name="jaxserve-kv-drain-watch", daemon=True).start()

    # ---- decode side -----------------------------------------------------------------------
    def may_dial(self, control_url: str) -> bool:
        """A control endpoint this instance may dial: a configured peer, or — with a token
        configured, so that every transfer parameter reaching the engine carried it — any."""
        parts = urllib.parse.urlsplit(control_url)
        if parts.scheme != "http" or not parts.hostname or parts.username or parts.password:
            return False
        if self.config.token is not None:
            return True
        try:
            return normalize_peer(f"{parts.hostname}:{parts.port or 80}") in self.config.peers
        except ValueError:
            return False

    def start_pull(self, key: str, params: dict, descriptor: dict, specs: list) -> None:
        for name in ("transfer_id", "control_url"):
            if not isinstance(params.get(name), str) or not params[name] or len(params[name]) > 2048:
                raise TransferError(f"kv_transfer_params.{name} must be a non-empty string")
        if not params["transfer_id"].isdigit() or len(params["transfer_id"]) > 20:
            raise TransferError(f"malformed transfer_id {params['transfer_id'][:40]!r}")
        if not self.may_dial(params["control_url"]):
            self._count("peers_refused")
            raise TransferError(
                f"control_url {params['control_url'][:200]!r} is not a prefill instance this "
                "decode instance may dial (kv_transfer.peers; or configure kv_transfer.token)"
            )
        with self._lock:
            if len(self._abandoned) >= MAX_ABANDONED_PULLS or len(self._pulls) >= self.config.max_pulls_in_flight:
                raise TransferCapacityError(f"{len(self._pulls)} pulls in flight (kv_transfer.max_pulls_in_flight)")
            pull = self._pulls[key] = _Pull(
                params, descriptor, specs, time.monotonic() + self.config.control_timeout_s + self.config.pull_timeout_s
            )
        self._count("transfers_started")
        threading.Thread(target=self._run_pull, args=(pull,), name="jaxserve-kv-pull", daemon=True).start()

    def _run_pull(self, pull: _Pull) -> None:
        try:
            if not pull.cancelled.is_set():
                pull.result = self._pull(pull)
            else:
                self._release(pull.params, "abort")
        except Exception as err:
            pull.error = err
        finally:
            pull.done.set()
            with self._lock:
                self._abandoned.discard(pull)

    def _pull(self, pull: _Pull) -> list:
        params, desc = pull.params, pull.descriptor
        base = params["control_url"].rstrip("/")
        claim = {
            "transfer_id": params["transfer_id"],
            "token_digest": desc["token_digest"],
            "model_fingerprint": desc["model"]["fingerprint"],
        }
        try:
            status, reply = post_json(
                base + "/kv_transfer/claim", claim, self.config.control_timeout_s, token=self.config.token
            )
        except OSError as err:
            raise TransferError(f"prefill instance unreachable: {err}") from None
        if status != 200:
            raise TransferError(f"claim refused ({status}): {str(reply.get('error'))[:200]}")
        address = reply.get("transfer_address")
        if not isinstance(address, str) or not _is_host_port(address):
            raise TransferError("the claim's reply names no transfer address (host:port)")
        if pull.cancelled.is_set():  # the client left while we claimed: free it at once
            self._release(params, "abort")
            raise TransferError("cancelled")
        if self._test_delay_s:
            log.info(
                "kv transfer %s claimed; test delay %.2fs before the pull", params["transfer_id"], self._test_delay_s
            )
            time.sleep(self._test_delay_s)
        arrays = self._connect(address).pull(int(params["transfer_id"]), pull.specs)
        arrays = jax.block_until_ready(arrays)
        self._release(params, "pulled")
        return list(arrays)

    def _release(self, params: dict, status: str) -> None:
        try:
            post_json(
                params["control_url"].rstrip("/") + "/kv_transfer/release",
                {"transfer_id": params["transfer_id"], "status": status},
                self.config.control_timeout_s,
                token=self.config.token,
            )
        except OSError as err:
            log.warning("kv transfer %s: release %s not delivered: %s", params["transfer_id"], status, err)

    def _connect(self, address: str):
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self._server.connect(address)
            return conn

    def poll(self) -> list[PullResult]:
        now, done = time.monotonic(), []
        with self._lock:
            items = list(self._pulls.items())
        for key, pull in items:
            if pull.done.is_set():
                if pull.error is None:
                    self._count("seconds_transferred", time.perf_counter() - pull.started)
                    self._count("bytes_pulled", sum(a.nbytes for a in pull.result))
                    done.append(PullResult(key, arrays=pull.result))
                else:
                    self._count("transfers_failed")
                    err = pull.error
                    done.append(PullResult(key, error=str(err) if isinstance(err, TransferError) else repr(err)))
            elif now > pull.deadline:
                self._count("transfers_failed")
                self._count("pulls_abandoned")
                with self._lock:
                    self._abandoned.add(pull)  # its thread may stay blocked; it no longer holds a slot
                done.append(PullResult(key, error=f"pull timed out after {self.config.pull_timeout_s}s"))
            else:
                continue
            with self._lock:
                self._pulls.pop(key, None)
        return done

    def pending(self) -> int:
        with self._lock:
            return len(self._pulls)

    def cancel(self, key: str) -> None:
        with self._lock:
            pull = self._pulls.pop(key, None)
        if pull is not None:  # not claimed yet: released by its thread; under way: completes, then "pulled"
            pull.cancelled.set()

    # ---- both ------------------------------------------------------------------------------
    def _count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def stats(self) -> dict[str, float]:
        leases, pages, slots, _ = self.leases.held()
        with self._lock:
            out = {f"kv_transfer_{k}": v for k, v in self.counters.items()}
            abandoned = len(self._abandoned)
        out.update(
            kv_transfer_leases_held=leases,
            kv_transfer_pages_held=pages,
            kv_transfer_slots_held=slots,
            kv_transfer_bytes_held=self.bytes_held(),
            kv_transfer_leases_expired=self.leases.num_expired,
            kv_transfer_pulls_in_flight=self.pending(),
            kv_transfer_pulls_stuck=abandoned,
        )
        return out

    def close(self) -> None:
        self._stop.set()
        if self._control is not None:
            self._control.close()
        with self._lock:
            pulls = list(self._pulls.values())
        for pull in pulls:
            pull.cancelled.set()


class _Pull:
    """One decode-side pull: its parameters, deadline and outcome (set by its thread)."""

    def __init__(self, params: dict, descriptor: dict, specs: list, deadline: float):
        self.params, self.descriptor, self.specs, self.deadline = params, descriptor, specs, deadline
        self.started = time.perf_counter()
        self.done, self.cancelled = threading.Event(), threading.Event()
        self.result: list | None = None
        self.error: BaseException | None = None


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536 and len(address) <= 300)
