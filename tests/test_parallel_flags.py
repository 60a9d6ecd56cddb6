"""vLLM's parallelism names: `--tensor-parallel-size` / `LLM(tensor_parallel_size=)` set the mesh's
model axis, `--data-parallel-size` / `LLM(data_parallel_size=)` its data axis (attention DP);
`--enable-expert-parallel` / `LLM(enable_expert_parallel=True)` set `parallel.expert`."""

import pytest

from configs import ConfigError
from runtime.engine.llm import LLM
from server.cli import _load, _parser, main


def _config(*argv):
    return _load(_parser().parse_args(["serve", *argv]))


def test_tensor_parallel_size_sets_the_model_axis():
    config = _config("--tensor-parallel-size", "4", "--data-parallel-size", "1")
    assert (config.parallel.mesh.data, config.parallel.mesh.model) == (1, 4)


def test_data_parallel_size_sets_the_data_axis():
    config = _config("--tensor-parallel-size", "4", "--data-parallel-size", "2")
    assert (config.parallel.mesh.data, config.parallel.mesh.model) == (2, 4)


def test_data_parallelism_with_a_pd_role_is_refused():
    with pytest.raises(ConfigError, match="attention data parallelism.*role='prefill'"):
        _config("--data-parallel-size", "2", "--set", "parallel.role=prefill")


@pytest.mark.parametrize(
    "argv,match",
    [
        (("--data-parallel-size", "0"), "--data-parallel-size must be >= 1"),
        (("--tensor-parallel-size", "0"), "must be >= 1"),
    ],
)
def test_invalid_parallelism_is_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        _config(*argv)


def test_cli_exits_2_on_refused_flag(capsys):
    assert main(["config", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
    ],
)
def test_llm_refuses_invalid_parallelism_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/checkpoint", **kwargs)  # refused before any file is read


def test_llm_tensor_parallel_size_is_the_engine_mesh():
    from runtime.engine.llm import _mesh_shape

    assert _mesh_shape(4, 1, False) == (1, 4)
    assert _mesh_shape(1, 1, False) is None  # one device, no mesh
    assert _mesh_shape(2, 4, False) == (4, 2) and _mesh_shape(1, 2, False) == (2, 1)


def test_enable_expert_parallel_sets_parallel_expert():
    from runtime.engine.loading import engine_config_from_launch

    config = _config("--tensor-parallel-size", "4", "--enable-expert-parallel")
    assert config.parallel.expert is True and config.parallel.mesh.model == 4
    assert engine_config_from_launch(config, "m").expert_parallel is True
    assert _config("--tensor-parallel-size", "4").parallel.expert is False  # default: expert-intermediate TP
