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

The engine sees this through `KVTransferHooks`, the typed interface it calls (`build_kv_transfer`
picks `DisaggregationHooks` for a P/D role when the engine is built, None for "both"), and the hooks
see the engine through `EngineRequests`, its public methods: they admit, refuse and end requests by
asking the engine (which alone sets a request's status) and never read its private state.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

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
from runtime.kv_transfer.latent_layout import check_pulled_scales, is_quantized
from runtime.kv_transfer.layout import (
    conv_permutation,
    expected_arrays,
    gather_request_state,
    model_groups,
    pull_specs,
    write_request_state,
)
from runtime.kv_transfer.spec_layout import (
    MTP,
    check_drafter,
    expected_mtp,
    gather_mtp,
    num_mtp_arrays,
    recompute_draft,
    write_mtp,
)
from runtime.kv_transfer.window_layout import window_layers
from runtime.scheduled import SchedulerOutput
from runtime.scheduling.request import Request
from runtime.types import EngineBusy, EngineRequest, FinishReason, RequestDelta, SamplingParams

log = logging.getLogger("jaxserve.kv_transfer")
IDLE_WAIT_S = 0.002
OFFER = "_offer"  # internal mark of a prepared prefill-role request (never accepted from clients)


class EngineRequests(Protocol):
    """What the hooks may ask of the engine (`LLMEngine` implements it)."""

    def check_fits(self, req: Request) -> None:
        """ValueError now if the scheduler could never serve `req`."""

    def admit(self, req: Request) -> None:
        """Queue `req` (parked until now) in the scheduler."""

    def has_scheduled(self) -> bool:
        """Whether the scheduler holds unfinished requests (waiting or running)."""

    def finish_request(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None, *, error: str | None = None
    ) -> RequestDelta:
        """End `req` (the engine's one ending) and return its final output."""

    def adopt_token(self, req: Request, token: int) -> RequestDelta:
        """`token`, sampled elsewhere, as `req`'s next output token: the stop rules and its output."""


class KVTransferHooks(Protocol):
    """What the engine calls at each hook point of a P/D role (see the module doc)."""

    def prepare(self, request: EngineRequest) -> EngineRequest: ...
    def park(self, req: Request, params: dict | None) -> bool: ...
    def poll(self) -> list[RequestDelta]: ...
    def load(self, caches: dict, out: SchedulerOutput) -> dict: ...
    def capture(self, caches: dict, out: SchedulerOutput) -> None: ...
    def finished(self, req: Request) -> dict | None: ...
    def abort_parked(self, request_id: str) -> bool: ...
    def has_pending(self) -> bool: ...
    def stats(self, engine_stats: dict) -> dict: ...
    def close(self) -> None: ...


def build_kv_transfer(
    config: KVTransferConfig | None, engine: EngineRequests, *, model, caches: dict, cache_config, opts
) -> KVTransferHooks | None:
    """The hooks of `config`'s role, built with the engine (None for role "both")."""
    if config is None or config.role == "both":
        return None
    return DisaggregationHooks(config, engine, model=model, caches=caches, cache_config=cache_config, opts=opts)


class DisaggregationHooks:
    """`KVTransferHooks` for the prefill and decode roles, over a connector from KV_CONNECTORS."""

    def __init__(self, config: KVTransferConfig, engine: EngineRequests, *, model, caches: dict, cache_config, opts):
        self.engine = engine
        self.config = config
        self.model, self.opts, self.page_size = model, opts, cache_config.page_size
        self.connector = KV_CONNECTORS.create(config.connector, config)
        self.num_pages = cache_config.num_pages
        self.num_slots = max(cache_config.num_state_slots, 2)
        self.conv_perm = conv_permutation(model)
        # window-aware paging: the window layers' pool travels apart (runtime/kv_transfer/window_layout.py)
        self.window_paging, self.num_window_pages = cache_config.window is not None, cache_config.num_window_pages
        self.windowed = window_layers(model.cfg, len(caches["kv"]), self.window_paging)
        self.signature = model_signature(
            model.cfg,
            model_groups(caches, self.num_pages, self.num_slots, self.windowed),
            fingerprint=checkpoint_fingerprint(model.path),
        )
        kv = [x for x in caches["kv"] if x is not None]
        # FP8 KV: the prefill side computes all N prompt tokens. The last-token rule: adopt for FP8
        # KV next to GDN state (whose state after N-1 tokens a full prefill never holds), else N-1.
        self._computes_last_token = bool(kv) and is_quantized(kv[0])
        hybrid = model.cfg.is_hybrid  # recurrent layers (not just fewer KV pools: MLP-only blocks have none)
        self.rule = ADOPT_RULE if hybrid and self._computes_last_token else LAST_TOKEN_RULE
        # speculative drafters (runtime/kv_transfer/spec_layout.py): the MTP's rows travel, a draft model's are recomputed
        self.mtp, self.draft = MTP in caches, "draft" in caches
        self._offering: dict[str, tuple | None] = {}  # prefill: request id -> captured (arrays, descriptor)
        self._lease_s: dict[str, float] = {}  # prefill: a request's own shorter lease
        self._parked: dict[str, tuple[Request, dict]] = {}  # decode: pulling, not yet in the scheduler
        self._staged: dict[str, tuple[list, dict]] = {}  # decode: pulled, waiting for admission
        self._staged_bytes: dict[str, int] = {}  # decode: bytes of each pulling or staged request
        self._ready: list[RequestDelta] = []  # errors and adopted first tokens, for the next step
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

    def capture(self, caches, out) -> None:
        for seq in out.sequences:
            if seq.sample and seq.request_id in self._offering:
                req = seq.request
                captured = gather_request_state(
                    caches,
                    self.model.cfg,
                    prompt_token_ids=req.prompt_token_ids,
                    num_tokens=seq.start_position
                    + seq.num_new_tokens
                    - int(self._computes_last_token and self.rule == LAST_TOKEN_RULE),
                    block_table=seq.block_table,
                    state_slot=seq.state_slot,
                    page_size=self.page_size,
                    num_pages=self.num_pages,
                    num_slots=self.num_slots,
                    conv_perm=self.conv_perm,
                    rule=self.rule,
                    signature=self.signature,
                    window_block_table=seq.window_block_table,
                    num_window_pages=self.num_window_pages,
                )
                if self.mtp:  # the MTP layer's rows and carry, for a decode side drafting with them
                    captured = gather_mtp(
                        caches,
                        *captured,
                        block_table=seq.block_table,
                        state_slot=seq.state_slot,
                        num_pages=self.num_pages,
                        num_slots=self.num_slots,
                    )
                self._offering[seq.request_id] = captured

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
            self.engine.check_fits(req)  # registered only once it cannot be refused
            self._offering[req.request_id] = None
            if params.get("lease_s"):
                self._lease_s[req.request_id] = float(params["lease_s"])
            return False
        if not params or not params.get("do_remote_prefill"):
            return False
        self.engine.check_fits(req)  # refuse now what the scheduler would refuse later
        try:
            desc = params.get("descriptor")
            check_descriptor(desc, prompt_token_ids=req.prompt_token_ids, signature=self.signature)
            expected_arrays(desc, self.model.cfg, self.window_paging, expected_mtp(desc, self.model.cfg))
            check_drafter(desc, self.mtp)
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

    def poll(self) -> list[RequestDelta]:
        for result in self.connector.poll():
            entry = self._parked.pop(result.key, None)
            if entry is None:
                continue  # cancelled meanwhile
            req, desc = entry
            error = result.error
            if result.arrays is not None:
                try:  # FP8 scales a page cannot be used with (NaN, zero, negative): not admitted
                    check_pulled_scales(result.arrays, desc, self.model.cfg)
                except Exception as err:  # never the engine loop's failure: this request's
                    error = str(err) if isinstance(err, TransferError) else f"unusable pulled state ({err!r:.200})"
            if result.arrays is None or error is not None:
                self._staged_bytes.pop(req.request_id, None)
                self._failed(req, error, in_engine=True)
                continue
            req.num_external_tokens = desc["num_tokens"]
            self._staged[req.request_id] = (result.arrays, desc)
            self.engine.admit(req)
            if desc["rule"] == ADOPT_RULE:  # queued with the adopted token, fed by its first step
                # emitted exactly once, ended by the stop rules as a step's token would be (an end
                # while still waiting: nothing allocated, nothing to load; `finished` unstages it)
                self._ready.append(self.engine.adopt_token(req, desc["first_token"]))
        errors, self._ready = self._ready, []
        if self._parked and not self.engine.has_scheduled():
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
                self.engine.admit(req)
            return
        self.num_errors += 1
        self._ready.append(self.engine.finish_request(req, "abort", error=f"kv transfer failed: {reason}"))

    def load(self, caches, out):
        """Write pulled state into the pages/slot of requests admitted this step."""
        for req in out.external_loads:
            arrays, desc = self._staged[req.request_id]
            self._unstage(req.request_id)
            n_mtp = num_mtp_arrays(desc)
            arrays, mtp_arrays = arrays[: len(arrays) - n_mtp], arrays[len(arrays) - n_mtp :]
            main = {k: caches[k] for k in ("kv", "conv", "rec")}
            main = write_request_state(
                main,
                arrays,
                desc,
                block_table=req.block_table,
                state_slot=req.state_slot,
                page_size=self.page_size,
                num_pages=self.num_pages,
                num_slots=self.num_slots,
                opts=self.opts,
                conv_perm=self.conv_perm,
                window_block_table=req.allocation.window_block_table if self.window_paging else None,
                num_window_pages=self.num_window_pages,
                windowed=self.windowed,
            )
            caches = {**caches, **main}
            if self.mtp:  # (a decode side without the MTP drops its rows)
                caches = write_mtp(
                    caches,
                    mtp_arrays,
                    desc,
                    block_table=req.block_table,
                    state_slot=req.state_slot,
                    page_size=self.page_size,
                    num_pages=self.num_pages,
                    num_slots=self.num_slots,
                    opts=self.opts,
                )
            if self.draft:  # the draft model's K/V of the pulled tokens, computed here
                draft = recompute_draft(
                    self.model.params["draft"],
                    caches["draft"],
                    req.prompt_token_ids[: desc["num_tokens"]],
                    req.block_table,
                    page_size=self.page_size,
                    draft_cfg=self.model.draft.cfg,
                    opts=self.opts,
                )
                caches = {**caches, "draft": draft}
        for seq in out.sequences:
            self._unstage(seq.request_id)  # admitted with a better local prefix hit
        return caches

    def _unstage(self, request_id: str) -> None:
        self._staged.pop(request_id, None)
        self._staged_bytes.pop(request_id, None)

    def abort_parked(self, request_id: str) -> bool:
        """Cancel the pull of a parked request; False if it is not parked (the engine ends it either way)."""
        if self._parked.pop(request_id, None) is None:
            return False
        self._staged_bytes.pop(request_id, None)
        self.connector.cancel(request_id)
        return True

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


__all__ = ["DisaggregationHooks", "EngineRequests", "KVTransferHooks", "build_kv_transfer"]
