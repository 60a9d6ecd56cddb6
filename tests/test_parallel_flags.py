"""vLLM's parallelism names: `--tensor-parallel-size` / `LLM(tensor_parallel_size=)` set the mesh's
model axis, `--data-parallel-size` / `LLM(data_parallel_size=)` its data axis (attention DP);
expert parallelism is refused naming issue 13 (not built yet), never silently ignored."""

import pytest

from configs import ConfigError
from runtime.llm import LLM
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


@pytest.mark.parametrize("argv,match", [
    (("--data-parallel-size", "0"), "--data-parallel-size must be >= 1"),
    (("--enable-expert-parallel",), "expert parallelism is not built yet \\(issue 13\\)"),
    (("--tensor-parallel-size", "0"), "must be >= 1"),
])
def test_unbuilt_parallelism_is_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        _config(*argv)


def test_cli_exits_2_on_refused_flag(capsys):
    assert main(["config", "--enable-expert-parallel"]) == 2
    assert "issue 13" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,match", [
    ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
    ({"enable_expert_parallel": True}, "expert parallelism is not built yet"),
])
def test_llm_refuses_unbuilt_parallelism_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/checkpoint", **kwargs)  # refused before any file is read


def test_llm_tensor_parallel_size_is_the_engine_mesh():
    from runtime.llm import _mesh_shape

    assert _mesh_shape(4, 1, False) == (1, 4)
    assert _mesh_shape(1, 1, False) is None  # one device, no mesh
    assert _mesh_shape(2, 4, False) == (4, 2) and _mesh_shape(1, 2, False) == (2, 1)
