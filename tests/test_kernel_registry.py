"""Each op's implementations are named once (its `KERNELS` table) and "auto" is resolved by one rule.

The launch schema's literal choices (configs/ imports nothing of ours), the ops layer's
plugin-open registries and the execution plan all agree with the tables.
"""

from __future__ import annotations

import pytest

from configs.schema import BUILTIN_NAMES
from models import ops
from pallas_kernels import gdn, quantized_matmul
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.kernel_impls import Kernel, resolve
from runtime.engine_config import EngineConfig
from runtime.steps.execution_plan import plan_execution


def test_schema_choices_are_the_tables_names():
    assert BUILTIN_NAMES["attention_backend"] == ("auto", *rpa.KERNELS)
    assert BUILTIN_NAMES["gdn_backend"] == ("auto", *gdn.KERNELS)


def test_registries_hold_every_table_entry_with_its_facts():
    for registry, table in ((ops.ATTENTION_BACKENDS, rpa.KERNELS), (ops.GDN_BACKENDS, gdn.KERNELS)):
        assert set(table) <= set(registry.names())
        for name, kernel in table.items():
            entry = registry.get(name)
            assert (entry.kv_bits, entry.per_shard, entry.auto) == (kernel.kv_bits, kernel.per_shard, kernel.auto)


# op -> platform (or "interpret": CPU with Pallas interpret mode) -> what "auto" means
AUTO = {
    "attention": {"cpu": "native", "gpu": "pallas", "tpu": "pallas", "interpret": "pallas"},
    "gdn": {"cpu": "native", "gpu": "pallas", "tpu": "pallas", "interpret": "pallas"},
    "matmul": {"cpu": "reference", "gpu": "pallas", "tpu": "pallas", "interpret": "pallas"},
}


@pytest.mark.parametrize("op", sorted(AUTO))
def test_one_auto_rule_for_ops_and_the_execution_plan(op):
    for key, want in AUTO[op].items():
        platform, interpret = ("cpu", True) if key == "interpret" else (key, False)
        assert ops.resolve_impl(op, "auto", platform, interpret) == want
        assert ops.resolve_impl(op, "reference", platform, interpret) == "reference"  # a name is itself
    for platform in ("cpu", "gpu", "tpu"):
        plan = plan_execution(EngineConfig(model="m"), _Model(), platform)
        assert plan.attention_path == ops.resolve_impl("attention", "auto", platform)
        assert plan.gdn_path == ops.resolve_impl("gdn", "auto", platform)


class _Model:
    num_layers, is_hybrid = 4, True


def test_kv_bit_storage_is_the_entrys_fact():
    jnp_paths = {name for name, kernel in rpa.KERNELS.items() if kernel.kv_bits}
    assert jnp_paths == {"native", "chunked", "reference"}
    for name in rpa.KERNELS:
        assert ops.KernelOptions(attention=name).kv_bit_storage == (name in jnp_paths)
        plan = plan_execution(EngineConfig(model="m", attention_backend=name), _Model(), "cpu")
        assert plan.kv_bit_storage == (name in jnp_paths)


def test_unknown_names_are_refused_listing_the_table():
    import numpy as np

    t, h, d = 4, 2, 8
    qk, vg = np.zeros((t, h, d), np.float32), np.zeros((t, h), np.float32)
    operands = (qk, qk, qk, vg, vg, np.zeros((2, h, d, d), np.float32), np.array([0, t]), np.array([1]))
    with pytest.raises(ValueError, match=r"unknown impl 'nope'; known: \('reference'"):
        gdn.gated_delta_rule(*operands, np.array([False]), np.int32(1), impl="nope")
    with pytest.raises(ValueError, match=r"matmul_backend must be 'auto' or one of \['reference', 'pallas'"):
        ops.KernelOptions(matmul="chunked")
    with pytest.raises(ValueError, match="no implementation is picked by 'auto'"):
        resolve({"only": Kernel(print)}, "auto", "cpu")
    assert set(quantized_matmul.KERNELS) == {"reference", "pallas", "pallas_tpu", "pallas_gpu"}
