"""Everything about the verifier, the model being served: loading (load.py), where families differ
(adapters.py: one adapter each), the aux-layer tap used by extraction and online training (tap.py), the KV-cache
runner used by the engine (runner.py) and the target head used by training (head.py)."""

from .adapters import (
    FAMILIES,
    GENERIC,
    Adapter,
    VerifierError,
    adapter_for,
    check_tappable,
    decoder_layers,
    default_aux_layers,
    flavour_of,
    register,
    registered_families,
)
from .head import VerifierHead
from .load import (
    EMBEDDED_NAME,
    cache_root,
    embedded_gguf_path,
    embedded_model_dir,
    embedding_rows,
    load_tokenizer,
    load_verifier,
    load_verifier_config,
    resolve_verifier,
    verifier_tensor,
)
from .runner import GenericRunner, VerifierRunner, make_runner
from .tap import Tap, batches_by_tokens, compute_samples

__all__ = [
    "EMBEDDED_NAME", "FAMILIES", "GENERIC", "Adapter", "GenericRunner", "Tap", "VerifierError", "VerifierHead",
    "VerifierRunner", "adapter_for", "batches_by_tokens", "cache_root", "check_tappable", "compute_samples",
    "decoder_layers", "default_aux_layers", "embedded_gguf_path", "embedded_model_dir", "embedding_rows",
    "flavour_of", "load_tokenizer", "load_verifier", "load_verifier_config", "make_runner", "register",
    "registered_families", "resolve_verifier", "verifier_tensor",
]
