"""Launch-config schema: the shipped YAMLs validate, errors name the field path, overrides apply."""

import pytest
import yaml
from pydantic import ValidationError

from configs import CONFIG_DIR, ConfigError, LaunchConfig, load_config, parse_override

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))
# devices each shipped config is written for (from its name): the mesh must use all of them
EXPECTED_DEVICES = {
    "cpu-demo.yaml": 1,
    "gpu-h200-qwen3_5-9b.yaml": 1,
    "tpu-v5e-8-qwen3_5-27b.yaml": 8,
    "tpu-v5p-16-qwen3-next-80b-multihost.yaml": 8,  # v5p-16 = 16 TensorCores = 8 chips
    "gpu-h200-qwen3_5-9b-prefill.yaml": 1,  # P/D pairs (docs/disaggregation.md)
    "gpu-h200-qwen3_5-9b-decode.yaml": 1,
    "tpu-v5e-8-qwen3_5-27b-prefill.yaml": 8,
    "tpu-v5e-8-qwen3_5-27b-decode.yaml": 8,
    "cpu-multihost-2x4.yaml": 8,  # 2 processes x 4 simulated CPU devices (docs/scaling.md, Multi-host)
}


def test_all_four_configs_ship():
    assert {p.name for p in SHIPPED} == set(EXPECTED_DEVICES)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, LaunchConfig)
    assert config.parallel.mesh.data * config.parallel.mesh.model == EXPECTED_DEVICES[path.name]
    assert config.scheduler.max_num_batched_tokens >= config.scheduler.max_num_seqs
    raw = yaml.safe_load(path.read_text())
    assert raw["cache"]["page_size"] == config.cache.page_size  # nothing silently dropped


def test_default_is_cpu_demo():
    config = load_config(None)
    assert config == load_config(CONFIG_DIR / "cpu-demo.yaml")
    assert config.model.path is None  # the default model
    assert config.parallel.mesh.data * config.parallel.mesh.model == 1  # one CPU device


def test_multihost_config_has_one_process_per_host():
    config = load_config(CONFIG_DIR / "tpu-v5p-16-qwen3-next-80b-multihost.yaml")
    assert config.parallel.multihost.num_processes == 2
    assert config.parallel.mesh.data == 2


@pytest.mark.parametrize(
    "overrides, field, fragment",
    [
        ({"cache.page_size": 24}, "cache.page_size", "power of two"),
        ({"cache.kv_cache_dtype": "int4"}, "cache.kv_cache_dtype", "'fp8_e4m3'"),
        ({"cache.memory_fraction": 0.5}, "cache", "not both"),
        ({"scheduler.policy": "lifo"}, "scheduler.policy", "fcfs"),
        ({"scheduler.max_num_seqs": 1024}, "scheduler", "max_num_batched_tokens"),
        ({"scheduler.token_buckets": [16, 8, 256]}, "scheduler", "increasing"),
        ({"scheduler.token_buckets": [16, 128]}, "scheduler", "must end at max_num_batched_tokens"),
        ({"server.port": 70000}, "server.port", "65535"),
        ({"server.api_key": " "}, "server.api_key", "non-empty"),
        ({"server.pot": 1}, "server.pot", "unknown field"),
        ({"kernels.gdn_backend": "triton"}, "kernels.gdn_backend", "pallas"),
        ({"kernels.layer_loop": "vmap"}, "kernels.layer_loop", "'unroll'"),
        ({"parallel.mesh.model": 0}, "parallel.mesh.model", "must be >= 1, got 0"),
        ({"parallel.role": "router"}, "parallel.role", "prefill"),
        (
            {"parallel.multihost": {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 2}},
            "parallel.multihost",
            "process_id (2) must be < num_processes (2)",
        ),
        (
            {"parallel.multihost": {"coordinator_address": "nohost", "num_processes": 2, "process_id": 0}},
            "parallel.multihost.coordinator_address",
            "HOST:PORT",
        ),
        ({"model.dtype": "int8"}, "model.dtype", "bfloat16"),
    ],
)
def test_errors_name_the_field(overrides, field, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert message.startswith(f"{field}: "), message
    assert fragment in message, message


def test_overrides_apply_dotted_and_nested():
    config = load_config(
        None,
        {
            "cache.page_size": 32,
            "server": {"port": 9001, "api_key": "k"},
            "parallel.multihost.coordinator_address": "h:1",
            "parallel.multihost.num_processes": 2,
            "parallel.multihost.process_id": 1,
        },
    )
    assert config.cache.page_size == 32
    assert config.server.port == 9001 and config.server.api_key == "k"
    assert config.server.host == "127.0.0.1"  # siblings of an overridden key are kept
    assert config.parallel.multihost.process_id == 1


def test_parse_override_reads_yaml_values():
    assert parse_override("cache.page_size=32") == ("cache.page_size", 32)
    assert parse_override("model.path=null") == ("model.path", None)
    assert parse_override("scheduler.token_buckets=[16, 256]") == ("scheduler.token_buckets", [16, 256])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("cache.page_size")


def test_config_is_frozen():
    config = load_config(None)
    with pytest.raises(ValidationError, match="frozen"):
        config.cache.page_size = 64


def test_bad_files(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("cache: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listed)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == LaunchConfig()


def test_kernels_step_options_reach_the_engine_config():
    from configs.schema import config_from_dict
    from runtime.engine.loading import engine_config_from_launch

    default = engine_config_from_launch(config_from_dict({}), "m")
    assert (default.layer_loop, default.fuse_greedy) == ("auto", None)
    cfg = engine_config_from_launch(config_from_dict({"kernels": {"layer_loop": "scan", "fuse_greedy": False}}), "m")
    assert (cfg.layer_loop, cfg.fuse_greedy) == ("scan", False)
    assert default.keep_gguf_quantized
    assert not engine_config_from_launch(
        config_from_dict({"model": {"keep_gguf_quantized": False}}), "m"
    ).keep_gguf_quantized


@pytest.mark.parametrize("stem", ["gpu-h200-qwen3_5-9b", "tpu-v5e-8-qwen3_5-27b"])
def test_pd_pairs_serve_one_model_with_their_own_shapes(stem):
    prefill = load_config(CONFIG_DIR / f"{stem}-prefill.yaml")
    decode = load_config(CONFIG_DIR / f"{stem}-decode.yaml")
    assert (prefill.parallel.role, decode.parallel.role) == ("prefill", "decode")
    assert prefill.model == decode.model  # one checkpoint, one served name
    assert decode.scheduler.max_num_batched_tokens < prefill.scheduler.max_num_batched_tokens
    assert prefill.kv_transfer.connector == decode.kv_transfer.connector == "jax_transfer"
    assert prefill.server.port != decode.server.port and prefill.kv_transfer.control_port


def test_serve_sets_the_gil_switch_interval(monkeypatch):
    """The engine thread shares the GIL with the HTTP loop: `server.gil_switch_interval_ms` is
    applied before serving (Python's default is 5 ms)."""
    import sys

    from server import runner

    seen = {}

    async def fake_serve_async(engine, server_config, *args, **kwargs):
        seen["interval"] = sys.getswitchinterval()
        return 0

    monkeypatch.setattr(runner, "serve_async", fake_serve_async)
    before = sys.getswitchinterval()
    try:
        config = load_config(None, {"server.gil_switch_interval_ms": 0.25})
        assert runner.serve(object(), config.server) == 0
        assert seen["interval"] == pytest.approx(0.25e-3)
        assert load_config(None).server.gil_switch_interval_ms == 0.5
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("stem", ["gpu-h200-qwen3_5-9b", "tpu-v5e-8-qwen3_5-27b"])
def test_shipped_pd_pairs_refuse_to_start_unsafe(stem, monkeypatch):
    """Issue 29 finding 5: the shipped pairs bind 0.0.0.0; without the token (and, for the
    prefill side, an address to advertise) `jaxserve serve` refuses before loading anything."""
    from server import cli
    from server.deployment import pd_deployment_error

    monkeypatch.delenv("JAXSERVE_KV_TRANSFER_TOKEN", raising=False)
    prefill, decode = (load_config(CONFIG_DIR / f"{stem}-{role}.yaml") for role in ("prefill", "decode"))
    assert "advertise_host" in pd_deployment_error(prefill)
    assert "JAXSERVE_KV_TRANSFER_TOKEN" in pd_deployment_error(decode)
    advertised = load_config(CONFIG_DIR / f"{stem}-prefill.yaml", {"kv_transfer.advertise_host": "10.0.0.5"})
    assert "JAXSERVE_KV_TRANSFER_TOKEN" in pd_deployment_error(advertised)
    insecure = load_config(CONFIG_DIR / f"{stem}-decode.yaml", {"kv_transfer.insecure": True})
    assert pd_deployment_error(insecure) is None
    monkeypatch.setenv("JAXSERVE_KV_TRANSFER_TOKEN", "a-deployment-token-0123456789")
    assert pd_deployment_error(load_config(CONFIG_DIR / f"{stem}-decode.yaml")) is None
    assert (
        pd_deployment_error(
            load_config(CONFIG_DIR / f"{stem}-prefill.yaml", {"kv_transfer.advertise_host": "10.0.0.5"})
        )
        is None
    )
    monkeypatch.delenv("JAXSERVE_KV_TRANSFER_TOKEN")
    assert cli.main(["serve", "--config", str(CONFIG_DIR / f"{stem}-decode.yaml"), "--fake-engine"]) == 2


def test_kv_transfer_token_comes_from_the_environment_and_is_never_printed(monkeypatch, capsys):
    from server import cli

    secret = "an-environment-token-0123456789"
    monkeypatch.setenv("JAXSERVE_KV_TRANSFER_TOKEN", secret)
    config = load_config(None, {"parallel.role": "decode"})
    assert config.kv_transfer.token.get_secret_value() == secret
    flag = load_config(None, {"kv_transfer.token": "a-flag-token-0123456789abc"})  # the CLI wins
    assert flag.kv_transfer.token.get_secret_value() == "a-flag-token-0123456789abc"
    assert cli.main(["config", "--set", "parallel.role=decode"]) == 0
    assert secret not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="kv_transfer.token: .*16 characters"):
        load_config(None, {"kv_transfer.token": "short"})
    monkeypatch.setenv("JAXSERVE_MULTIHOST_SECRET", "ignored-without-a-multihost-section")
    assert load_config(None).parallel.multihost is None  # a variable whose section is absent is ignored


def test_loopback_pd_roles_start_without_a_token():
    from server.deployment import is_loopback, pd_deployment_error

    assert pd_deployment_error(load_config(None, {"parallel.role": "prefill"})) is None
    exposed = load_config(None, {"parallel.role": "prefill", "server.host": "0.0.0.0"})
    assert "server.host '0.0.0.0'" in pd_deployment_error(exposed)
    assert [
        is_loopback(h)
        for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "0.0.0.0", "10.0.0.5", "example.com", "")
    ] == [True] * 5 + [False] * 4


def test_environment_variables_are_read_in_one_module():
    """Every JAXSERVE_* variable is read by configs/environment.py (and declared in its tables)."""
    import re

    from configs import environment

    root = CONFIG_DIR.parent
    offenders = []
    for package in ("configs", "models", "pallas_kernels", "paged_kv", "runtime", "server"):
        for path in (root / package).rglob("*.py"):
            if path.name == "environment.py" and path.parent.name == "configs":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(os\.environ|getenv)", line) and "JAXSERVE_" in line:
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, offenders
    source = (root / "configs" / "environment.py").read_text()
    assert set(re.findall(r"\"(JAXSERVE_[A-Z_]+)\"", source)) == {*environment.ENVIRONMENT, *environment.SETTINGS}
