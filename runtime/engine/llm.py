"""The offline API (vLLM-like): batch generation from Python, no server.

    from runtime import LLM, SamplingParams
    llm = LLM(model="/path/to/hf_dir",  # or an already loaded models.Model
              dtype="float32", max_num_seqs=64, max_num_batched_tokens=512)
    outs = llm.generate(["Hello", [3, 17, 5]], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
    llm.stats()

Arguments left out (None) take the launch schema's defaults (configs/schema.py), the same as a
YAML that leaves them out: the keyword arguments become launch keys and the engine config is
built by `runtime.engine_config.build_engine_config`, the one path. Other keyword arguments
are EngineConfig fields: those with a launch key (`max_model_len`, `layer_loop`, ...) go through
the launch config too; the engine-only ones (`interpret`, `seed`, ...) are passed through.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from configs.schema import BUILTIN_NAMES, apply_overrides, config_from_dict
from models.model import Model
from runtime.engine.llm_engine import LLMEngine
from runtime.engine_config import ENGINE_FIELD_KEYS, build_engine_config
from runtime.types import EngineRequest, RequestOutput, SamplingParams, accumulate, fan_out

Prompt = str | Sequence[int]


def _gdn_following(attention_backend: str | None) -> str | None:
    """GDN follows a built-in attention back-end's name unless given; a plugin's attention
    back-end leaves GDN on auto."""
    return attention_backend if attention_backend in BUILTIN_NAMES["gdn_backend"] else None


class LLM:
    def __init__(
        self,
        model: str | Model,
        *,
        dtype: str | None = None,
        page_size: int | None = None,
        num_pages: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool | None = None,
        kv_cache_dtype: str | None = None,
        attention_backend: str | None = None,
        gdn_backend: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        **engine_kwargs,
    ):
        loaded = model if isinstance(model, Model) else None
        mesh_shape = _mesh_shape(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
        if mesh_shape is not None:
            engine_kwargs.setdefault("mesh_shape", mesh_shape)
        if enable_expert_parallel:  # MoE experts split by expert index over tensor_parallel_size devices
            engine_kwargs.setdefault("expert_parallel", True)
        named = dict(
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend,
            gdn_backend=gdn_backend or _gdn_following(attention_backend),
        )
        fields = {
            **{k: v for k, v in named.items() if v is not None},  # None: the default
            **{k: v for k, v in engine_kwargs.items() if k in ENGINE_FIELD_KEYS},
        }  # None may mean something
        engine_only = {k: v for k, v in engine_kwargs.items() if k not in ENGINE_FIELD_KEYS}
        overrides = {ENGINE_FIELD_KEYS[k]: v for k, v in fields.items()}
        launch = config_from_dict(apply_overrides({}, overrides))  # ConfigError (a ValueError) naming the key
        config = build_engine_config(launch, str(loaded.path if loaded else model), **engine_only)
        self.engine = LLMEngine(config, model=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        order: list[tuple[str, int, int]] = []  # (engine request id, prompt index, completion index)
        added: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                ids = self._encode(prompt)
                for j, sub in enumerate(fan_out(p)):
                    rid = f"llm-{next(self._ids)}"
                    self.engine.add_request(EngineRequest(rid, ids, sub))
                    added.append(rid)
                    prompt_ids[rid] = ids
                    order.append((rid, i, j))
            finals: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(order), desc="generating", disable=not use_tqdm)
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    finals[delta.request_id] = accumulate(
                        finals.get(delta.request_id), delta, prompt_ids[delta.request_id]
                    )
                    if delta.finished:
                        bar.update(1)
            bar.close()
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise
        results: list[RequestOutput] = []
        for rid, i, j in order:
            out = finals[rid]
            out.outputs[0].index = j
            if j == 0:
                out.request_id = f"prompt-{i}"
                results.append(out)
            else:
                results[-1].outputs.append(out.outputs[0])
        return results

    def stats(self) -> dict:
        return self.engine.stats()


def _mesh_shape(tensor_parallel_size: int, data_parallel_size: int, enable_expert_parallel: bool):
    """vLLM's parallelism arguments -> EngineConfig.mesh_shape (data, model)."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1 and data_parallel_size == 1:
        return None
    return (data_parallel_size, tensor_parallel_size)
