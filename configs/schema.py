"""The launch-config schema: one frozen pydantic model per section of a launch YAML.

`load_config(path, overrides)` reads a YAML file (the shipped `cpu-demo.yaml` when `path` is
None), deep-merges overrides given as dotted keys (`{"cache.page_size": 32}`) or nested
dicts, validates, and returns a frozen `LaunchConfig`. Every error is a `ConfigError` whose
message starts with the dotted field path, e.g. `cache.page_size: must be a power of two`.
This module imports nothing else of jaxserve.

Defaults: the field defaults below are jaxserve's ONE set of defaults. Every engine is built
from a `LaunchConfig` by `runtime.engine_config.build_engine_config` (YAML, CLI flags and the
offline `LLM(...)` alike), and `EngineConfig`'s own field defaults are read from `DEFAULTS`
here, so a knob left unset means the same everywhere. Rules: a field the engine's configs hold
too is checked by the rule in configs/rules.py that they call as well; a name that plugins may
add (back-ends, policies) by `check_name`, the one check against the registries. Section classes
are named `*Section` where a `*Config` name already means something else
(models.config.ModelConfig, runtime.engine_config.CacheConfig / SchedulerConfig / KVTransferConfig).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from configs import rules
from configs.environment import environment_overrides
from configs.speculative import speculative_field

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_CONFIG = CONFIG_DIR / "cpu-demo.yaml"

# Kernel back-ends: "auto" (resolved by `models.ops.resolve_impl`) + the op's `KERNELS` names
# (pallas_kernels/ragged_paged_attention.py, gdn.py), written out as configs/ imports nothing of
# ours; tests/test_kernel_registry.py keeps them equal. Plugins add names (entry points
# `attention_backend.<name>` etc. in `jaxserve.plugins`), read here without importing them.
_KERNELS = ("auto", "reference", "chunked", "native", "pallas", "pallas_tpu", "pallas_gpu")
BUILTIN_NAMES = {
    "attention_backend": _KERNELS,
    "gdn_backend": (*_KERNELS[:4], "reference_chunked", *_KERNELS[4:]),
    "scheduling_policy": ("fcfs", "priority"),
}
PLUGIN_GROUP = "jaxserve.plugins"  # models.registry.PLUGIN_GROUP (configs imports nothing of ours)


def registered_names(kind: str) -> list[str]:
    """Built-in names of `kind` plus those installed distributions add through entry points."""
    plugins = [
        ep.name.partition(".")[2] for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name.startswith(kind + ".")
    ]
    return list(dict.fromkeys([*BUILTIN_NAMES[kind], *plugins]))


def check_name(kind: str, value: str) -> str:
    """`value` if it names a `kind` (built in or installed), else ValueError listing the known ones.
    The one check of a name against the registries: the schema and runtime.engine_config call it."""
    if value in BUILTIN_NAMES[kind]:
        return value  # without reading the installed distributions' entry points
    names = registered_names(kind)
    if value not in names:
        raise ValueError(f"unknown {kind} {value!r}; known (built-in and installed): {names}")
    return value


def _named(kind: str) -> AfterValidator:
    return AfterValidator(lambda value: check_name(kind, value))


Backend = Annotated[str, _named("attention_backend")]
GdnBackend = Annotated[str, _named("gdn_backend")]
Policy = Annotated[str, _named("scheduling_policy")]
# fields the engine's configs hold too (runtime/engine_config.py): the rule both call
Count = Annotated[int, AfterValidator(rules.at_least(1))]
Seconds = Annotated[float, AfterValidator(rules.positive)]
Bytes = Annotated[int, AfterValidator(rules.positive)]
Secret = Annotated[SecretStr | None, AfterValidator(rules.optional(rules.secret_strength))]


class ConfigError(ValueError):
    """A launch config is invalid; the message names the field path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """Which checkpoint to serve. `path: null` serves the default (tiny) model."""

    path: str | None = None
    # float32: the CPU test bench's dtype (XLA:CPU runs bf16 matmuls more slowly); accelerator
    # configs set bfloat16 (configs/*.yaml).
    dtype: Annotated[str, AfterValidator(rules.one_of(rules.DTYPES))] = "float32"
    # None: from the checkpoint's config.json
    max_model_len: Annotated[int | None, AfterValidator(rules.optional(rules.max_model_len))] = None
    served_model_name: str | None = None  # None: the checkpoint directory's name
    # online weight quantization (docs/quantization.md); None: weights as the checkpoint stores them
    quantization: Literal["int8", "fp8", "w8a8-int8", "w8a8-fp8", "int4", "int4-zp", "int4-sym"] | None = None
    quantization_group_size: Literal[32, 64, 128] = 32  # int4 schemes; 32 measured best (docs/quantization.md)
    quantization_keep_float: list[str] | None = None  # module-path globs kept in float; None: the defaults
    # GGUF Q4_0 / Q4_1 / Q8_0 blocks stay quantized (4-8x less memory). On CPU the quantized matmuls
    # decode 0.2-0.7x as fast (docs/quantization.md): false dequantizes them at load instead.
    keep_gguf_quantized: bool = True


class CacheSection(_Section):
    """Paged KV pool and GDN state slots. Size it by `num_pages` or by `memory_fraction`."""

    page_size: Annotated[int, AfterValidator(rules.page_size)] = 16
    num_pages: Annotated[int | None, AfterValidator(rules.optional(rules.num_pages))] = None
    memory_fraction: Annotated[float | None, AfterValidator(rules.optional(rules.memory_fraction))] = None
    kv_cache_dtype: Annotated[str, AfterValidator(rules.one_of(rules.KV_CACHE_DTYPES))] = "auto"
    # GDN state slots (conv window and recurrent state); the recurrence computes in float32 either
    # way. bfloat16 halves the state per sequence (docs/prefix_caching.md, "State dtype").
    state_dtype: Annotated[str, AfterValidator(rules.one_of(rules.STATE_DTYPES))] = "float32"
    enable_prefix_caching: bool = True
    # GDN hybrids: where state checkpoints are taken (paged_kv/checkpoint_policy.py) and the largest fraction
    # of cache memory their slots may use (null: 2 x max_num_seqs slots shared). docs/prefix_caching.md.
    hybrid_checkpoint_policy: str = Field(default="auto", pattern=r"^(auto|page|ends|every_page|align:\d+)(,\w+=\d+)*$")
    hybrid_checkpoint_budget: Annotated[float | None, AfterValidator(rules.optional(rules.checkpoint_budget))] = 0.25
    # sliding-window layers' KV in a window-sized pool (paged_kv/window_pages.py); null: on where a model has them
    window_paging: bool | None = None
    # host-memory tier for evicted KV pages and GDN checkpoints, in GiB (vLLM's kv_offloading_size); 0/null: off
    kv_offloading_size: Annotated[float | None, AfterValidator(rules.optional(rules.at_least(0)))] = None
    kv_offloading_backend: Annotated[str | None, AfterValidator(rules.optional(rules.one_of(("native",))))] = None

    @model_validator(mode="after")
    def _one_sizing_rule(self) -> CacheSection:
        if self.num_pages is not None and self.memory_fraction is not None:
            raise ValueError("set num_pages or memory_fraction, not both")
        return self


class SchedulerSection(_Section):
    """Per-step budget and policy. `token_buckets: null` means powers of two up to the max."""

    max_num_seqs: Count = 64
    max_num_batched_tokens: Count = 512
    policy: Policy = "fcfs"  # a name in runtime.scheduling.policies.POLICY_REGISTRY (plugins add more)
    token_buckets: tuple[int, ...] | None = None
    # Plan step n+1 while step n runs, its tokens fed on the device (runtime/engine/llm_engine.py); false:
    # the host waits for each step's tokens before it schedules the next.
    async_scheduling: bool = True

    @model_validator(mode="after")
    def _budget_is_consistent(self) -> SchedulerSection:
        rules.batch_budget(self.max_num_batched_tokens, self.max_num_seqs)
        buckets = self.token_buckets
        if buckets is not None:
            if not buckets or any(b < 1 for b in buckets):
                raise ValueError("token_buckets must be a non-empty list of positive integers")
            if any(a >= b for a, b in itertools.pairwise(buckets)):
                raise ValueError("token_buckets must be strictly increasing")
            if buckets[-1] != self.max_num_batched_tokens:
                raise ValueError(
                    f"token_buckets must end at max_num_batched_tokens ({self.max_num_batched_tokens}), "
                    f"got {buckets[-1]}"
                )
        return self


class MeshConfig(_Section):
    """Device mesh of one model replica set: `data` x `model` devices."""

    data: Count = 1
    model: Count = 1

    @property
    def num_devices(self) -> int:
        return self.data * self.model


class MultihostConfig(_Section):
    """Arguments of `jax.distributed.initialize` for multi-host slices."""

    coordinator_address: str
    num_processes: int = Field(ge=1)
    process_id: int = Field(ge=0)
    # Multi-process serving (runtime/parallel/multihost.py): process 0 sends its steps to the others over
    # TCP on the coordinator's host at this port (null: the coordinator's port + 1).
    step_port: int | None = Field(default=None, ge=1, le=65535)
    heartbeat_timeout_s: float = Field(default=5.0, gt=0)  # a follower silent this long is lost
    step_timeout_s: float = Field(default=600.0, gt=0)  # one executable call (first-use compiles included)
    # Simulated CPU devices per process (`jax_num_cpu_devices`): several processes on one machine.
    cpu_devices: int | None = Field(default=None, ge=1)
    # The step channel's shared key (HMAC handshake and frame digests), the same on every process;
    # set it through the environment (JAXSERVE_MULTIHOST_SECRET). Required unless every address
    # is loopback (docs/scaling.md, "Deploying safely").
    secret: Secret = None
    # HOST:PORT that process 0's JAX coordinator binds; its step channel binds the same host.
    # null: coordinator_address itself, not every interface.
    coordinator_bind_address: str | None = None

    @field_validator("coordinator_address", "coordinator_bind_address")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _process_id_in_range(self) -> MultihostConfig:
        if self.process_id >= self.num_processes:
            raise ValueError(f"process_id ({self.process_id}) must be < num_processes ({self.num_processes})")
        return self


class ParallelConfig(_Section):
    mesh: MeshConfig = MeshConfig()
    multihost: MultihostConfig | None = None
    # MoE expert parallelism: routed experts split by expert index over the `model` axis (E/M whole
    # experts per device, tokens moved by all-to-all); false: split on the expert intermediate dim.
    expert: bool = False
    # MLA (DeepSeek-V3, Kimi) under TP: the latent pool replicated on every chip (query heads split),
    # or split by token over `model` (each chip 1/model of the rows; logsumexp combine, models/mla_split.py);
    # auto: the measured rule (models/mla_split.py AUTO_RULE)
    mla_latent: Annotated[str, AfterValidator(rules.one_of(rules.MLA_LATENT))] = "replicated"
    role: Annotated[str, AfterValidator(rules.one_of(rules.ROLES))] = "both"
    # The accelerator the config is written for (a key of configs/chips.py) and, for a TPU slice,
    # its topology ("2x4", "2x2x2"): what `jaxserve plan` compiles for. null: the local devices.
    chip: str | None = None
    topology: str | None = None

    @field_validator("chip")
    @classmethod
    def _known_chip(cls, value: str | None) -> str | None:
        from configs.chips import CHIPS

        if value is not None and value not in CHIPS:
            raise ValueError(f"unknown chip {value!r}; known: {', '.join(sorted(CHIPS))}")
        return value

    @field_validator("topology")
    @classmethod
    def _topology_shape(cls, value: str | None) -> str | None:
        if value is not None and not all(part.isdigit() and int(part) > 0 for part in value.split("x")):
            raise ValueError(f"must be chip counts joined by 'x', e.g. 2x4 or 2x2x2, got {value!r}")
        return value

    @model_validator(mode="after")
    def _data_parallel_serves_both_roles(self):
        if self.mesh.data > 1 and self.role != "both":
            raise ValueError(
                f"mesh.data={self.mesh.data} (attention data parallelism) with role={self.role!r}: "
                "P/D disaggregation runs with data: 1"
            )
        return self


class KVTransferSection(_Section):
    """P/D disaggregation (`parallel.role: prefill | decode`; docs/disaggregation.md)."""

    connector: str = "jax_transfer"  # a name in runtime.kv_transfer.KV_CONNECTORS (plugins add more)
    lease_s: Seconds = 60.0  # prefill side: offered state is freed after this
    pull_timeout_s: Seconds = 30.0  # decode side: a claimed pull may take this long
    # decode side: prefill locally, or fail
    on_pull_failure: Annotated[str, AfterValidator(rules.one_of(rules.PULL_FAILURE_ACTIONS))] = "recompute"
    host: str = "127.0.0.1"  # bind address of the control and transfer servers
    advertise_host: str | None = None  # the address the other instance dials (default: host)
    control_port: int = Field(default=0, ge=0, le=65535)  # 0 picks a free port
    # The internal credential between `jaxserve proxy` and the P/D instances (header
    # X-KV-Transfer-Token; environment JAXSERVE_KV_TRANSFER_TOKEN): an instance honours
    # `kv_transfer_params` and serves /kv_transfer/* only for requests that carry it.
    token: Secret = None
    # Serve a P/D role on a non-loopback address without a token (logged as a warning every minute).
    insecure: bool = False
    # Decode side: the prefill control endpoints ("host:port") it may dial. With a token, also any
    # that token-bearing transfer parameters name (they came through the proxy).
    peers: list[Annotated[str, AfterValidator(rules.normalize_peer)]] = []
    max_held_bytes: Bytes = 4 << 30  # prefill side: offered state held at once (503 past it)
    max_staged_bytes: Bytes = 4 << 30  # decode side: state pulling or waiting for pages
    max_pulls_in_flight: Count = 64  # decode side: concurrent pulls
    control_timeout_s: Seconds = 5.0  # one claim / release exchange, end to end


class CompileConfig(_Section):
    aot: bool = True  # compile every executable at start-up (then nothing compiles while serving); false: on first use
    cache_dir: str | None = None  # JAX persistent compilation cache; None disables it


class KernelsConfig(_Section):
    attention_backend: Backend = "auto"
    gdn_backend: GdnBackend = "auto"
    # How the step runs the layers: one compiled layer group under lax.scan (compile time flat in
    # depth), or unrolled (weights read in place; faster on CPU for small models). auto: unroll
    # on the CPU backend for models of up to 16 layers, scan otherwise.
    layer_loop: Annotated[str, AfterValidator(rules.one_of(rules.LAYER_LOOPS))] = "auto"
    # A second backbone per decode-sized token bucket (<= max_num_seqs) with the argmax fused in,
    # used by steps whose requests are all plain greedy (one dispatch, no sampling metadata).
    # null: the plan decides (runtime/steps/execution_plan.py): on for bf16 dense models on CPU (a greedy
    # decode step is then one executable, >= 5 % measured), off otherwise.
    fuse_greedy: bool | None = None


class ServerConfig(_Section):
    """The HTTP front end."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0 picks a free port
    api_key: str | None = None  # None: no authentication
    max_waiting_requests: int = Field(default=256, ge=1)  # 429 beyond this many queued requests
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)  # 413 beyond this
    drain_timeout_s: float = Field(default=30.0, ge=0.0)  # SIGTERM: wait this long for in-flight requests
    # The engine died (e.g. a multi-host follower was lost): keep answering /health 503 this long
    # before draining and exiting 1, so a load balancer or supervisor sees it.
    unhealthy_linger_s: float = Field(default=0.0, ge=0.0)
    body_read_timeout_s: float = Field(default=30.0, gt=0.0)  # 408 when a request body trickles in slower
    chat_template: str | None = None  # a Jinja template (or a file holding one) replacing the model's
    trust_request_chat_template: bool = False  # allow clients' `chat_template` (vLLM's flag); off: 400
    chat_template_timeout_s: float = Field(default=5.0, gt=0.0)  # a longer render is stopped: 400
    reasoning_parser: Literal["qwen3"] | None = None  # split <think>...</think> into reasoning_content
    # Tool calls (server/tool_parser.py): the format calls are parsed from and forced in (vLLM's
    # --tool-call-parser names); whether tools without a tool_choice, or tool_choice "auto", parse
    # calls (vLLM's --enable-auto-tool-choice, on here by default); the most calls in one answer
    # when parallel_tool_calls is on (off: one).
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"
    enable_auto_tool_choice: bool = True
    max_tool_calls: int = Field(default=8, ge=1, le=128)
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0.0)  # structured output: slower -> 400
    # Python's GIL switch interval while serving (sys.setswitchinterval; Python's default is 5 ms).
    # With `engine_process: false` the engine loop thread shares the GIL with the HTTP event loop:
    # when a step's tokens are ready it waits for the GIL until the event loop's thread yields it,
    # at the latest after this interval, while a small model's whole step takes 3-5 ms on CPU.
    # See server/runner.serve. (The engine process sets it too, for its command reader thread.)
    gil_switch_interval_ms: float = Field(default=0.5, gt=0.0, le=100.0)
    # Run the engine loop in a child process (runtime/engine/process_client.py, vLLM's EngineCore
    # layout), so the engine's Python and the HTTP event loop do not share one GIL. False: a
    # thread of the server's process (runtime/engine/thread_client.py: AsyncEngine). Multi-host and P/D
    # roles always use the thread.
    engine_process: bool = True

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty string or null")
        return value


class LaunchConfig(_Section):
    """Everything one `jaxserve` process needs; YAML and CLI flags only fill it."""

    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    parallel: ParallelConfig = ParallelConfig()
    kv_transfer: KVTransferSection = KVTransferSection()
    compile: CompileConfig = CompileConfig()
    kernels: KernelsConfig = KernelsConfig()
    server: ServerConfig = ServerConfig()
    # speculative decoding, vLLM's mapping (configs/speculative.py); null: off
    speculative_config: Annotated[dict[str, Any] | None, BeforeValidator(speculative_field)] = None


DEFAULTS = LaunchConfig()  # the one set of defaults (runtime.engine_config.EngineConfig reads its own from here)
# cache.memory_fraction: null (and no num_pages) budgets this fraction of device memory
DEFAULT_MEMORY_FRACTION = 0.9


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> LaunchConfig:
    """Read, merge and validate a launch config. Raises `ConfigError` naming the field path."""
    path = DEFAULT_CONFIG if path is None else Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    overrides = overrides or {}
    from_environment = environment_overrides(apply_overrides(raw, overrides))
    return config_from_dict(apply_overrides(apply_overrides(raw, from_environment), overrides))


def config_from_dict(raw: Mapping[str, Any]) -> LaunchConfig:
    """Validate an already-parsed config mapping."""
    try:
        return LaunchConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None


def apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` (dotted keys or nested dicts) into a copy of `raw`."""
    merged = copy.deepcopy(dict(raw))
    for key, value in overrides.items():
        parts = key.split(".")
        node = merged
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[: depth + 1])}: is not a section, cannot set {key}")
            node = child
        leaf = parts[-1]
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = apply_overrides(node[leaf], value)
        else:
            node[leaf] = copy.deepcopy(value)
    return merged


def parse_override(text: str) -> tuple[str, Any]:
    """`"cache.page_size=32"` -> `("cache.page_size", 32)`; the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. cache.page_size=32")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"{key.strip()}: invalid value {value!r}: {err}") from None


def _describe(err: ValidationError) -> str:
    lines = []
    for issue in err.errors():
        where = ".".join(str(part) for part in issue["loc"]) or "<root>"
        message = issue["msg"]
        if issue["type"] == "extra_forbidden":
            message = "unknown field"
        elif message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        lines.append(f"{where}: {message}")
    return "; ".join(lines)
