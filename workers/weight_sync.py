"""Moving weights from the trainer into running vLLM engines.

The trainer serialises its state dict once per version (safetensors bytes, so the
engine's RPC can carry it) and each engine loads it through ``WeightSyncExtension``,
a vLLM worker extension running inside the engine process. ``reload_weights`` is
used rather than ``model.load_weights`` because the CPU backend repacks weights after
loading (DESIGN.md §4).
"""
from __future__ import annotations

import hashlib
import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def serialize_state_dict(state: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a HF state dict. Tensors sharing storage (tied embeddings)
    are cloned, since safetensors refuses shared tensors."""
    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return st_save(tensors)


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes())
    return h.hexdigest()


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods are reached
    with ``engine.collective_rpc(name, args=...)``."""

    def fluxrl_load_weights(self, blob: bytes) -> dict:
        t0 = time.perf_counter()
        tensors = st_load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._fluxrl_retie_embeddings()
        self._fluxrl_checksum = tensors_checksum(tensors)
        return {"load_ms": (time.perf_counter() - t0) * 1000, "checksum": self._fluxrl_checksum}

    def _fluxrl_retie_embeddings(self) -> None:
        # The layerwise reload loads embed_tokens but, finding no lm_head weight, puts
        # the *old* lm_head tensor back: with tied embeddings the tie is broken and the
        # output layer keeps stale weights. Copy the new embedding into it.
        model = self.model_runner.get_model()
        if not getattr(model.config, "tie_word_embeddings", False):
            return
        head, embed = model.lm_head, model.model.embed_tokens
        if head.weight is embed.weight:
            return
        if hasattr(head, "cpu_linear"):  # CPU backend: lm_head runs on a repacked copy
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            head.weight = embed.weight
            dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        elif head.weight.shape == embed.weight.shape:
            with torch.no_grad():
                head.weight.copy_(embed.weight)

    def fluxrl_loaded_checksum(self) -> str | None:
        return getattr(self, "_fluxrl_checksum", None)
