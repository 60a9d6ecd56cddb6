"""The engine's side of disaggregation: what `LLMEngine` calls at each of its hook points.

Prefill role (`kv_transfer_params: {"do_remote_decode": true}`): `prepare` turns the request into
"compute the prompt, sample one greedy token"; `capture` gathers the pages and state slot right
after the step that computed them; `finished` offers them through the connector and returns the
transfer parameters the response carries. The pages go back to the pool (and the prefix cache)
as usual: the lease holds a gathered copy, which nothing can overwrite.

The last-token rule (descriptor `rule`): by default the state of the first N-1 prompt tokens
is shipped and the sampled token thrown away (`prefill_n_minus_1`; dense FP8 computes all N so
the pages get a colocated engine's per-page scales, and ships N-1). A GDN hybrid with FP8 KV
ships the state after all N tokens plus its sampled token (`prefill_n_adopt`): its GDN state
after N-1 and the FP8 scales a colocated engine gives the page of token N cannot both hold.

Decode role (`{"do_remote_prefill": true, transfer_id, ..., descriptor}`): `park` validates the
descriptor against this model and prompt and starts the pull; `poll` (every step) moves pulled
requests into the scheduler with `num_external_tokens` = the descriptor's tokens (N-1, or N
after emitting the adopted first token once, as a step would), or on failure recomputes
locally (default) or fails the request with an error, counted; `load` writes the pulled state
into the pages and slot the scheduler allocated, before that step's forward pass feeds token N
(or the adopted token).
"""

from __future__ import annotations

import logging
import time

from models.fingerprint import checkpoint_fingerprint
from runtime.engine_config import KVTransferConfig
from runtime.kv_transfer import KV_CONNECTORS
from runtime.kv_transfer.base import TransferCapacityError, TransferError
from runtime.kv_transfer.descriptor import (
    ADOPT_RULE,
    LAST_TOKEN_RULE,
    check_descriptor,
    descriptor_nbytes,
    model_signature,
)
from runtime.kv_transfer.layout import (
    conv_permutation,
    expected_arrays,
    gather_request_state,
    model_groups,
    pull_specs,
    write_request_state,
)
from runtime.scheduling.request import Request, RequestStatus
from runtime.types import EngineBusy, EngineRequest, RequestOutput, SamplingParams

log = logging.getLogger("jaxserve.kv_transfer")
IDLE_WAIT_S = 0.002
OFFER = "_offer"  # internal mark of a prepared prefill-role request (never accepted from clients)


def build_kv_transfer(engine, config: KVTransferConfig | None) -> KVTransferHooks | None:
    if config is None or config.role == "both":
        return None
    return KVTransferHooks(engine, config)


class KVTransferHooks:
    def __init__(self, engine, config: KVTransferConfig):
        self.engine = engine
        self.config = config
        self.connector = KV_CONNECTORS.create(config.connector, config)
        self.num_pages = engine.cache_config.num_pages
        self.num_slots = max(engine.cache_config.num_state_slots, 2)
        self.conv_perm = conv_permutation(engine.model)
        self.signature = model_signature(
            engine.model.cfg,
            model_groups(engine.caches, self.num_pages, self.num_slots),
            fingerprint=checkpoint_fingerprint(engine.model.path),
        )
        self._offering: dict[str, tuple | None] = {}  # prefill: request id -> captured (arrays, descriptor)
        self._lease_s: dict[str, float] = {}  # prefill: a request's own shorter lease
        self._parked: dict[str, tuple[Request, dict]] = {}  # decode: pulling, not yet in the scheduler
        self._staged: dict[str, tuple[list, dict]] = {}  # decode: pulled, waiting for admission
        self._staged_bytes: dict[str, int] = {}  # decode: bytes of each pulling or staged request
        self._ready: list[RequestOutput] = []  # errors and adopted first tokens, for the next step
        self.num_fallbacks = 0
        self.num_errors = 0

    # ---- prefill role ----------------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> EngineRequest:
        params = request.kv_transfer_params
        if not params:
            return request
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        if params.get("do_remote_prefill"):
            if self.config.role != "decode":
                raise ValueError(
                    f"kv_transfer_params.do_remote_prefill: this instance's role is {self.config.role!r}, not decode"
                )
            return request
        if not params.get("do_remote_decode"):
            raise ValueError(
                "kv_transfer_params must set do_remote_decode (to a prefill instance) or "
                "do_remote_prefill (to a decode instance)"
            )
        if self.config.role != "prefill":
            raise ValueError(
                f"kv_transfer_params.do_remote_decode: this instance's role is {self.config.role!r}, not prefill"
            )
        if not self.connector.has_room():
            raise EngineBusy(
                "kv_transfer_params: this prefill instance holds its most offered state "
                "(kv_transfer.max_held_bytes); retry later"
            )
        lease_s = params.get("lease_s")  # a shorter hold than the instance's lease_s (never longer)
        if lease_s is not None and (
            isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0
        ):
            raise ValueError(f"kv_transfer_params.lease_s must be a positive number of seconds, got {lease_s!r}")
        prompt = list(request.prompt_token_ids)
        if len(prompt) == 1:  # a one-token prompt has nothing to ship: decode computes it
            return EngineRequest(
                request.request_id,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0),
                priority=request.priority,
                arrival_time=request.arrival_time,
            )
        # FP8 pages: compute all N tokens (the page holding token N then has the scales a
        # colocated engine gives it); a dense model ships the first N-1, a hybrid all N plus the
        # sampled token (the adopt rule). Otherwise compute and ship N-1.
        computed = prompt if self._computes_last_token else prompt[:-1]
        return EngineRequest(
            request.request_id,
            computed,
            SamplingParams(max_tokens=1, temperature=0.0),
            priority=request.priority,
            arrival_time=request.arrival_time,
            kv_transfer_params={OFFER: True, "lease_s": lease_s},
        )

    @property
    def _computes_last_token(self) -> bool:
        """FP8 KV: the prefill side computes all N prompt tokens."""
        kv = [x for x in self.engine.caches["kv"] if x is not None]
        return bool(kv) and kv[0].k_scale is not None

    @property
    def rule(self) -> str:
        """This prefill instance's last-token rule: adopt for FP8 KV next to GDN state (whose
        state after N-1 tokens a full prefill never holds), else N-1."""
        hybrid = any(x is None for x in self.engine.caches["kv"])
        return ADOPT_RULE if hybrid and self._computes_last_token else LAST_TOKEN_RULE

    def capture(self, caches, out) -> None:
        for seq in out.sequences:
            if seq.sample and seq.request_id in self._offering:
                req = seq.request
                self._offering[seq.request_id] = gather_request_state(
                    caches,
                    self.engine.model.cfg,
                    prompt_token_ids=req.prompt_token_ids,
                    num_tokens=seq.start_position
                    + seq.num_new_tokens
                    - int(self._computes_last_token and self.rule == LAST_TOKEN_RULE),
                    block_table=seq.block_table,
                    state_slot=seq.state_slot,
                    page_size=self.engine.config.page_size,
                    num_pages=self.num_pages,
                    num_slots=self.num_slots,
                    conv_perm=self.conv_perm,
                    rule=self.rule,
                    signature=self.signature,
                )

    def finished(self, req: Request) -> dict | None:
        """The transfer parameters of a finished prefill-role request (None: nothing offered)."""
        self._unstage(req.request_id)
        captured = self._offering.pop(req.request_id, None)
        lease_s = self._lease_s.pop(req.request_id, None)
        if captured is None or req.finish_reason in ("abort", "error"):  # fail closed
            return None
        if captured[1]["rule"] == ADOPT_RULE:  # ship the sampled token with the state after it
            tokens = req.resolved_output_token_ids
            if not tokens:
                return None
            captured[1]["first_token"] = int(tokens[0])
        try:
            offer = self.connector.offer(*captured, **({"lease_s": lease_s} if lease_s else {}))
        except TransferCapacityError as err:  # answered without an offer: the decode side prefills
            log.warning("request %s: not offered: %s", req.request_id, err)
            return None
        return {"do_remote_prefill": True, **offer}

    # ---- decode role -----------------------------------------------------------------------
    def park(self, req: Request, params: dict | None) -> bool:
        """True if `req` now waits for a pull (the engine must not schedule it yet)."""
        if params and params.get(OFFER):  # prefill role: offer its state once computed
            self.engine.scheduler._check_fits(req)  # registered only once it cannot be refused
            self._offering[req.request_id] = None
            if params.get("lease_s"):
                self._lease_s[req.request_id] = float(params["lease_s"])
            return False
        if not params or not params.get("do_remote_prefill"):
            return False
        self.engine.scheduler._check_fits(req)  # refuse now what the scheduler would refuse later
        try:
            desc = params.get("descriptor")
            check_descriptor(desc, prompt_token_ids=req.prompt_token_ids, signature=self.signature)
            expected_arrays(desc, self.engine.model.cfg)
            nbytes = descriptor_nbytes(desc)
            if sum(self._staged_bytes.values()) + nbytes > self.config.max_staged_bytes:
                raise TransferCapacityError("pulled state waiting here would exceed kv_transfer.max_staged_bytes")
            self.connector.start_pull(req.request_id, params, desc, pull_specs(desc))
        except TransferCapacityError as err:
            raise EngineBusy(f"kv_transfer_params: {err}; retry later") from None
        except Exception as err:
            reason = str(err) if isinstance(err, TransferError) else f"unusable transfer parameters ({err!r:.200})"
            if self.config.on_pull_failure == "error":
                self.num_errors += 1
                raise ValueError(f"kv_transfer_params: {reason}") from None
            self._failed(req, reason, in_engine=False)
            return False
        if desc["rule"] == ADOPT_RULE and not self._can_adopt(req):
            # The shipped token is the prefill side's greedy pick and the state is past it: this
            # request's own sampling could pick another, so it prefills locally (exact; counted).
            self.connector.cancel(req.request_id)  # releases the lease (or drops a pull under way)
            self.num_fallbacks += 1
            log.info("request %s: sampling parameters differ from greedy; prefilling locally", req.request_id)
            return False
        self._parked[req.request_id] = (req, desc)
        self._staged_bytes[req.request_id] = nbytes
        return True

    @staticmethod
    def _can_adopt(req: Request) -> bool:
        """The prefill side's greedy first token is this request's first token (no logprobs: the
        prefill side does not ship them)."""
        p = req.params
        return (
            p.temperature <= 0.0
            and p.logprobs is None
            and p.prompt_logprobs is None
            and p.repetition_penalty == 1.0
            and not p.logit_bias
            and p.structured_output is None
            and p.max_tokens != 0
            and not req.banned_token_ids()
        )

    def _adopt(self, req: Request, token: int) -> RequestOutput:
        """Emit the prefill side's first token as this request's first output (exactly once),
        applying the request's stop rules as a step's token would."""
        engine = self.engine
        req.append_output([token])
        end = req.stop_check(engine.max_model_len)
        detok = engine._detok.get(req.request_id)
        hit = detok.add([token]) if detok is not None else None
        if end is None and hit is not None:
            end = ("stop", hit)
        if end is not None:  # still waiting: nothing allocated, nothing to load
            engine.scheduler.finish(req.request_id, *end)
            self._unstage(req.request_id)
        return engine._output(req, finished=req.is_finished)

    def poll(self) -> list[RequestOutput]:
        for result in self.connector.poll():
            entry = self._parked.pop(result.key, None)
            if entry is None:
                continue  # cancelled meanwhile
            req, desc = entry
            if result.arrays is None:
                self._staged_bytes.pop(req.request_id, None)
                self._failed(req, result.error, in_engine=True)
                continue
            req.num_external_tokens = desc["num_tokens"]
            self._staged[req.request_id] = (result.arrays, desc)
            self.engine.scheduler.add_request(req)
            if desc["rule"] == ADOPT_RULE:  # queued with the adopted token, fed by its first step
                self._ready.append(self._adopt(req, desc["first_token"]))
        errors, self._ready = self._ready, []
        if self._parked and not self.engine.scheduler.has_unfinished():
            time.sleep(IDLE_WAIT_S)  # only pulls in flight: don't spin
        return errors

    def _failed(self, req: Request, reason: str, *, in_engine: bool) -> None:
        log.warning(
            "request %s: kv transfer failed (%s); %s",
            req.request_id,
            reason,
            "prefilling locally" if self.config.on_pull_failure == "recompute" else "failing it",
        )
        if self.config.on_pull_failure == "recompute":
            self.num_fallbacks += 1
            if in_engine:
                self.engine.scheduler.add_request(req)
            return
        self.num_errors += 1
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        output = self.engine._output(req, finished=True)
        output.error = f"kv transfer failed: {reason}"
        self._ready.append(output)

    def load(self, caches, out):
        """Write pulled state into the pages/slot of requests admitted this step."""
        for req in out.external_loads:
            arrays, desc = self._staged[req.request_id]
            self._unstage(req.request_id)
            caches = write_request_state(
                caches,
                arrays,
                desc,
                block_table=req.block_table,
                state_slot=req.state_slot,
                page_size=self.engine.config.page_size,
                num_pages=self.num_pages,
                num_slots=self.num_slots,
                opts=self.engine.opts,
                conv_perm=self.conv_perm,
            )
        for seq in out.sequences:
            self._unstage(seq.request_id)  # admitted with a better local prefix hit
        return caches

    def _unstage(self, request_id: str) -> None:
        self._staged.pop(request_id, None)
        self._staged_bytes.pop(request_id, None)

    def abort_parked(self, request_id: str) -> Request | None:
        entry = self._parked.pop(request_id, None)
        if entry is None:
            return None
        self._staged_bytes.pop(request_id, None)
        self.connector.cancel(request_id)
        req = entry[0]
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        return req

    # ---- both ------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self._parked or self._ready)

    def stats(self, engine_stats: dict) -> dict[str, float]:
        """The engine's stats with the transfer's added; requests still pulling count as waiting
        (the server's 429 check reads num_waiting)."""
        return {
            **engine_stats,
            **self.connector.stats(),
            "kv_transfer_fallbacks": self.num_fallbacks,
            "kv_transfer_errors": self.num_errors,
            "kv_transfer_requests_pulling": len(self._parked),
            "kv_transfer_bytes_staged": sum(self._staged_bytes.values()),
            "num_waiting": engine_stats.get("num_waiting", 0) + len(self._parked),
        }

    def close(self) -> None:
        self.connector.close()


__all__ = ["KVTransferHooks", "build_kv_transfer"]
