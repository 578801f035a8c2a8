"""Architecture adapters: where verifier families differ, in one place each.

An adapter says how to reach a Hugging Face causal LM's parts (decoder layers, final norm, lm_head, embedding
rows), which draft-layer flavour follows its config, and whether paradraft's fast KV-cache runner (runner.py)
implements its layers exactly. A family the fast runner knows is one file in families/; any other decoder-only
model with the usual `model.layers` / `model.norm` / `lm_head` runs through the generic adapter, which leaves the
layers to Hugging Face's own forward and cache (slower, same tokens).

Aux hidden-state convention (the same tensor vLLM's EAGLE-3 path hands the drafter): "layer i" is the residual
stream at the INPUT of decoder layer i, i.e. Hugging Face `output_hidden_states[i]` (index 0 = the embeddings).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import torch

from ..errors import UserError
from .linear import linear


class VerifierError(UserError, RuntimeError):
    """A verifier that cannot be found, converted or tapped."""


@dataclass(frozen=True)
class Adapter:
    """How paradraft drives one family of verifiers."""

    family: str  # the HF model_type(s) it covers, for messages
    flavour: str = "llama"  # draft decoder layer that follows the verifier's layer config: "llama" | "qwen3"
    fast: bool = True  # runner.VerifierRunner implements these layers exactly (else: Hugging Face's forward)
    moe: bool = False  # experts with a router (the MLP returns (hidden, router scores) in some families)

    def layers(self, model) -> torch.nn.ModuleList:
        """The decoder layer list."""
        return model.model.layers

    def final_norm(self, model) -> torch.nn.Module:
        return model.model.norm

    def logits(self, model, normed: torch.Tensor, small_m: bool = True, tiles=None) -> torch.Tensor:
        """lm_head over final-normed states, with the output transforms configs declare: Granite's
        `logits_scaling` (divide) and Gemma's `final_logit_softcapping` (tanh cap). small_m: decoding's timed
        small-M rule (linear.py) may pick the product's path; False runs the module as it is (the same bits in
        every process). tiles: the lm_head's weight packed by kernels.pack_tiles (the engine's runner), or None."""
        out = linear(model.lm_head, normed, tiles) if small_m else model.lm_head(normed)  # [..., V]
        scale = getattr(model.config, "logits_scaling", None)
        if scale:
            out = out / scale
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def embedding_rows(self, model) -> int:
        """Rows of the input embedding (the vocabulary as the model sees it; a padded tokenizer has fewer)."""
        return int(model.get_input_embeddings().weight.shape[0])


# model_type -> adapter of the families the fast runner implements. Each family is one file in families/ that
# calls `register`; every module there is imported on first use, so a new family is one new file.
FAMILIES: dict[str, Adapter] = {}
GENERIC = Adapter("generic", fast=False)
_loaded = False


def register(*model_types: str, **kw) -> Adapter:
    """Declare the adapter of one family (one or more HF model_types); keyword arguments as for Adapter."""
    adapter = Adapter("/".join(model_types), **kw)
    for t in model_types:
        FAMILIES[t] = adapter
    return adapter


def registered_families() -> dict[str, Adapter]:
    """Every registered family (imports the modules of families/ once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(f"{__package__}.families")
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
    return FAMILIES


def adapter_for(model) -> Adapter:
    """The adapter of a loaded model; VerifierError naming what is missing when it cannot be tapped at all."""
    mtype = getattr(model.config, "model_type", "?")
    inner = getattr(model, "model", None)
    missing = [name for name, ok in (
        ("model.layers", isinstance(getattr(inner, "layers", None), torch.nn.ModuleList)),
        ("model.norm", isinstance(getattr(inner, "norm", None), torch.nn.Module)),
        ("model.embed_tokens", getattr(inner, "embed_tokens", None) is not None),
        ("lm_head", isinstance(getattr(model, "lm_head", None), torch.nn.Module)),
    ) if not ok]
    if missing:
        raise VerifierError(f"verifier architecture '{mtype}' ({type(model).__name__}) cannot be tapped: paradraft "
                            f"needs a decoder-only causal LM with model.layers, model.norm, model.embed_tokens and "
                            f"lm_head; this one lacks {', '.join(missing)}")
    return registered_families().get(mtype, GENERIC)


def flavour_of(config) -> str:
    """Draft-layer flavour that follows a verifier config."""
    return registered_families().get(getattr(config, "model_type", ""), GENERIC).flavour


def check_tappable(model) -> None:
    """Raise VerifierError unless paradraft can tap the model (the fast runner or the generic adapter)."""
    adapter_for(model)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM (VerifierError when there is none to tap)."""
    return adapter_for(model).layers(model)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 default aux layer ids [2, L//2, L-3] for an L-layer verifier."""
    if num_layers < 7:  # fewer layers would tap one layer twice
        raise VerifierError(f"a {num_layers}-layer verifier is too shallow for 3 distinct default aux layers "
                            f"[2, L//2, L-3] (it needs >= 7 layers); choose 3 with `paradraft extract --layers A,B,C` "
                            f"and train offline on those hidden states")
    return [2, num_layers // 2, num_layers - 3]
