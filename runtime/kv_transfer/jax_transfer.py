"""The default connector: arrays move with `jax.experimental.transfer`, control over HTTP/JSON.

Prefill side: `offer` registers the gathered arrays with `TransferServer.await_pull(uuid, ...)`
and a lease; the control server answers claim / release (control.py). Decode side: a worker
thread claims the transfer (one-shot: a replayed id is refused, never served), pulls with
`connect(address).pull(uuid, specs)` (device to device on TPU/GPU, process to process on CPU),
then releases it as "pulled". A pull is only started after a successful claim because pulling a
uuid nobody awaits blocks forever.

State nobody will pull (lease expired, decode aborted before pulling) is drained by pulling it
from this process's own transfer server: the transfer API has no cancel.

Test hook: `JAXSERVE_TEST_KV_PULL_DELAY_S` (environment, decode side) sleeps that long between a
successful claim and the pull, so a fault test can kill the prefill instance mid-pull.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.experimental.transfer  # noqa: F401 - registers jax.experimental.transfer

from runtime.kv_transfer.base import KVConnector, KVTransferConfig, PullResult, TransferError
from runtime.kv_transfer.control import ControlServer, post_json
from runtime.kv_transfer.leases import Lease, LeaseTable

log = logging.getLogger("jaxserve.kv_transfer")
CONTROL_TIMEOUT_S = 5.0
REAP_INTERVAL_S = 0.25
# Claims happen on these threads too: enough of them that a claim never waits behind slow pulls
# long enough for its lease to expire.
PULL_WORKERS = 16


class JaxTransferConnector(KVConnector):
    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        host = config.host
        self._server = jax.experimental.transfer.start_transfer_server(
            jax.devices()[0].client, f"{host}:0", [f"{host}:0"])
        self._advertise = config.advertise_host or host
        self._address = f"{self._advertise}:{self._server.address().rpartition(':')[2]}"
        self._lock = threading.Lock()
        self._connections: dict[str, object] = {}
        self._pool = ThreadPoolExecutor(max_workers=PULL_WORKERS, thread_name_prefix="jaxserve-kv-pull")
        self._pulls: dict[str, tuple[Future, float, dict, float]] = {}
        self.counters = {"transfers_offered": 0, "transfers_started": 0, "transfers_completed": 0,
                         "transfers_failed": 0, "bytes_transferred": 0, "bytes_pulled": 0, "seconds_transferred": 0.0,
                         "claims_refused": 0, "leases_drained": 0}
        self.leases = LeaseTable(config.lease_s)
        self._test_delay_s = float(os.environ.get("JAXSERVE_TEST_KV_PULL_DELAY_S", 0))
        self._control = None
        self._stop = threading.Event()
        if config.role == "prefill":
            self._control = ControlServer(host, config.control_port, {
                "/kv_transfer/claim": self._on_claim, "/kv_transfer/release": self._on_release})
            threading.Thread(target=self._reap, name="jaxserve-kv-leases", daemon=True).start()

    # ---- prefill side ----------------------------------------------------------------------
    def offer(self, arrays: list, descriptor: dict, lease_s: float | None = None) -> dict:
        uuid = secrets.randbits(62)
        nbytes = sum(a.nbytes for a in arrays)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
        held = descriptor["num_pages"] if any(n.startswith("kv") for n, _, _ in descriptor["arrays"]) else 0
        slots = 1 if any(n.startswith("rec") for n, _, _ in descriptor["arrays"]) else 0
        self._server.await_pull(uuid, arrays)
        self.leases.add(Lease(str(uuid), (arrays, specs), held, slots, nbytes, self.leases.new_deadline(lease_s)))
        self._count("transfers_offered")
        return {"transfer_id": str(uuid), "transfer_address": self._address,
                "control_url": f"http://{self._advertise}:{self._control.port}",
                "lease_s": min(self.config.lease_s, lease_s or self.config.lease_s),
                "descriptor": descriptor}

    def _on_claim(self, body: dict) -> tuple[int, dict]:
        lease = self.leases.claim(str(body.get("transfer_id")), self.config.pull_timeout_s)
        if lease is None:
            self._count("claims_refused")
            return 410, {"error": "unknown, expired, released or already claimed transfer id"}
        return 200, {"ok": True}

    def _on_release(self, body: dict) -> tuple[int, dict]:
        status = body.get("status")
        if status not in ("pulled", "abort"):
            return 400, {"error": "status must be 'pulled' or 'abort'"}
        lease = self.leases.release(str(body.get("transfer_id")))
        if lease is None:
            return 200, {"ok": False}
        if status == "pulled":
            self._count("transfers_completed")
            self._count("bytes_transferred", lease.nbytes)
        else:
            self._drain(lease)
        return 200, {"ok": True}

    def _reap(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            for lease in self.leases.pop_expired():
                log.warning("kv transfer %s: lease expired; freeing its state", lease.transfer_id)
                self._drain(lease)

    def _drain(self, lease: Lease) -> None:
        """Pull unclaimed state from ourselves so the transfer server lets go of it. A claimed
        lease may have been pulled already (a second pull would block): just drop our refs."""
        self._count("leases_drained")
        if lease.claimed:
            return
        _, specs = lease.payload

        def pull_own():
            try:
                jax.block_until_ready(self._connect(self._server.address()).pull(int(lease.transfer_id), specs))
            except Exception:  # noqa: BLE001 - best effort
                log.exception("draining transfer %s failed", lease.transfer_id)

        threading.Thread(target=pull_own, name="jaxserve-kv-drain", daemon=True).start()

    # ---- decode side -----------------------------------------------------------------------
    def start_pull(self, key: str, params: dict, descriptor: dict, specs: list) -> None:
        for field in ("transfer_id", "transfer_address", "control_url"):
            if not isinstance(params.get(field), str) or not params[field]:
                raise TransferError(f"kv_transfer_params.{field} must be a non-empty string")
        if not params["transfer_id"].isdigit():
            raise TransferError(f"malformed transfer_id {params['transfer_id']!r}")
        self._count("transfers_started")
        future = self._pool.submit(self._pull, params, specs)
        with self._lock:
            self._pulls[key] = (future, time.monotonic() + CONTROL_TIMEOUT_S + self.config.pull_timeout_s, params,
                                time.perf_counter())

    def _pull(self, params: dict, specs: list) -> list:
        base = params["control_url"].rstrip("/")
        try:
            status, reply = post_json(base + "/kv_transfer/claim", {"transfer_id": params["transfer_id"]},
                                      CONTROL_TIMEOUT_S)
        except OSError as err:
            raise TransferError(f"prefill instance unreachable: {err}") from None
        if status != 200:
            raise TransferError(f"claim refused ({status}): {reply.get('error')}")
        if self._test_delay_s:
            log.info("kv transfer %s claimed; test delay %.2fs before the pull", params["transfer_id"],
                     self._test_delay_s)
            time.sleep(self._test_delay_s)
        arrays = self._connect(params["transfer_address"]).pull(int(params["transfer_id"]), specs)
        arrays = jax.block_until_ready(arrays)
        self._release(params, "pulled")
        return list(arrays)

    def _release(self, params: dict, status: str) -> None:
        try:
            post_json(params["control_url"].rstrip("/") + "/kv_transfer/release",
                      {"transfer_id": params["transfer_id"], "status": status}, CONTROL_TIMEOUT_S)
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
        for key, (future, deadline, params, started) in items:
            if future.done():
                err = future.exception()
                if err is None:
                    self._count("seconds_transferred", time.perf_counter() - started)
                    self._count("bytes_pulled", sum(a.nbytes for a in future.result()))
                    done.append(PullResult(key, arrays=future.result()))
                else:
                    self._count("transfers_failed")
                    done.append(PullResult(key, error=str(err) if isinstance(err, TransferError) else repr(err)))
            elif now > deadline:
                self._count("transfers_failed")
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
            entry = self._pulls.pop(key, None)
        if entry is not None and entry[0].cancel():  # not started: the claim never happened
            self._pool.submit(self._release, entry[2], "abort")

    # ---- both ------------------------------------------------------------------------------
    def _count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def stats(self) -> dict[str, float]:
        leases, pages, slots, nbytes = self.leases.held()
        with self._lock:
            out = {f"kv_transfer_{k}": v for k, v in self.counters.items()}
        out.update(kv_transfer_leases_held=leases, kv_transfer_pages_held=pages, kv_transfer_slots_held=slots,
                   kv_transfer_bytes_held=nbytes, kv_transfer_leases_expired=self.leases.num_expired,
                   kv_transfer_pulls_in_flight=self.pending())
        return out

    def close(self) -> None:
        self._stop.set()
        if self._control is not None:
            self._control.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
