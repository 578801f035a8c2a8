"""FSDP for large drafters (torchrun on GPUs): each decoder layer and the whole model become FSDP2 units."""

from __future__ import annotations

import torch


def shard_fsdp(model: torch.nn.Module, mesh=None) -> torch.nn.Module:
    """Shard a drafter with FSDP2 (`fully_shard`): one unit per decoder layer, then the root.

    The frozen verifier embeddings are sharded like everything else; parameters stay float32 (autocast does the
    bf16 compute). Needs an initialized process group (torchrun). Returns the same module, now sharded.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """True when parameters are FSDP2 DTensors."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (a collective under FSDP: every rank must call it)."""
    if not is_sharded(model):
        return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sd = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
    # buffers (d2t, t2d) are not sharded and may be missing from the distributed view
    for k, v in model.named_buffers():
        if k in sd or k.startswith("rotary."):
            continue
        sd[k] = v.detach().cpu().contiguous()
    return sd


def load_full_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict into a (possibly FSDP-sharded) model."""
    if not is_sharded(model):
        model.load_state_dict(sd, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
