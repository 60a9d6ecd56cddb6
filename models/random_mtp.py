"""The MTP layer of tiny random Qwen3.5 / Qwen3-Next checkpoints (`random_checkpoint` writes it).

HF transformers has no MTP module (it ignores `mtp.*` on load), so the layer is assembled here from
HF's own classes, as the released checkpoints lay it out: `mtp.fc` ([H, 2H], no bias),
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (the family's decoder layer
of a full-attention index: MoE in Qwen3-Next) and `mtp.norm`, norms the family's (zero-centred).
Written to `mtp.safetensors` beside HF's `model.safetensors`; config.json gets
`mtp_num_hidden_layers: 1`. Tests rebuild the same module (`torch_mtp`) for their reference.
"""

from __future__ import annotations

from pathlib import Path

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
FILE = "mtp.safetensors"


def mtp_module(model):
    """An untrained MTP module for the HF causal LM `model` (torch), named as the checkpoints."""
    from torch import nn

    cfg = model.config
    inner = model.model
    idx = list(cfg.layer_types).index("full_attention")
    H, norm = cfg.hidden_size, type(inner.norm)

    class MTP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = norm(H, eps=cfg.rms_norm_eps)
            self.pre_fc_norm_hidden = norm(H, eps=cfg.rms_norm_eps)
            self.layers = nn.ModuleList([type(inner.layers[idx])(cfg, idx)])
            self.norm = norm(H, eps=cfg.rms_norm_eps)

    return MTP().to(next(model.parameters()).dtype).eval()


def write_mtp(model, out_dir: str | Path, fill, seed: int) -> None:
    """`fill(module, seed=...)`: random_checkpoint's filler. Adds `mtp_num_hidden_layers` to config.json."""
    import json

    from safetensors.torch import save_file

    module = mtp_module(model)
    fill(module, seed=seed + 1)
    save_file({f"mtp.{k}": v.contiguous() for k, v in module.state_dict().items()}, str(Path(out_dir) / FILE))
    path = Path(out_dir) / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))


def torch_mtp(model, checkpoint: str | Path):
    """The checkpoint's MTP module in torch (for references): `mtp_module` with its weights."""
    from safetensors.torch import load_file

    module = mtp_module(model)
    state = {k[len("mtp.") :]: v for k, v in load_file(str(Path(checkpoint) / FILE)).items()}
    module.load_state_dict(state, strict=True)
    return module
