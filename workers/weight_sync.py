"""Moving weights from the trainer into running vLLM engines.

The trainer serialises its state dict once per version (safetensors bytes, so the
engine's RPC can carry it) and each engine loads it through ``WeightSyncExtension``,
a vLLM worker extension running inside the engine process. ``reload_weights`` is
used rather than ``model.load_weights`` because the CPU backend repacks weights after
loading (docs/architecture.md §4).
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
        flat = t.reshape(-1)  # a 0-d tensor (a scalar buffer) cannot be viewed as bytes; the same bytes otherwise
        h.update(flat.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else flat.numpy().tobytes())
    return h.hexdigest()


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods are reached
    with ``engine.collective_rpc(name, args=...)``."""

    def fluxrl_load_weights(self, blob: bytes, force_reload: bool = False) -> dict:
        t0 = time.perf_counter()
        return self._fluxrl_apply(st_load(blob), force_reload, t0)

    # -- the collective transport (workers/weight_broadcast.py) ------------------------
    def fluxrl_join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                 backend: str = "gloo", timeout_s: float = 60.0, nccl_id: str | None = None) -> int:
        """Join the trainer's weight group (blocks until every member has); returns this
        worker's rank in it. A previous group is dropped (it is broken, or replaced)."""
        from .weight_broadcast import WeightGroup

        old = getattr(self, "_fluxrl_group", None)
        self._fluxrl_group = None
        if old is not None:
            old.close()
        rank = rank_offset + int(getattr(self, "rank", 0) or 0)
        self._fluxrl_group = WeightGroup(host, port, rank, world_size, backend, timeout_s,
                                         device=getattr(self, "device", None), nccl_id=nccl_id)
        return rank

    def fluxrl_receive_weights(self, meta: dict, force_reload: bool = False) -> dict:
        """Receive the state dict ``meta`` describes from the trainer's broadcast, then load
        it exactly as ``fluxrl_load_weights`` loads a blob. ``load_ms`` includes the receive
        (generation cannot run during either)."""
        group = getattr(self, "_fluxrl_group", None)
        if group is None:
            raise RuntimeError("this engine is not in a weight group (fluxrl_join_weight_group first)")
        t0 = time.perf_counter()
        tensors = group.receive(meta)
        recv_ms = (time.perf_counter() - t0) * 1000
        return {**self._fluxrl_apply(tensors, force_reload, t0), "recv_ms": recv_ms}

    def _fluxrl_apply(self, tensors: dict[str, torch.Tensor], force_reload: bool, t0: float) -> dict:
        path = "direct" if getattr(self, "_fluxrl_inplace", False) and not force_reload else "reload"
        if path == "direct":
            self._fluxrl_load_inplace(tensors)
        else:
            self._fluxrl_reload(tensors)
        # The checksum is computed when asked for: hashing every update would add
        # milliseconds to the generation stall.
        self._fluxrl_tensors, self._fluxrl_checksum = tensors, None
        return {"load_ms": (time.perf_counter() - t0) * 1000, "path": path}

    def _fluxrl_reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """vLLM's layerwise reload: generic, but it re-runs every layer's post-load
        processing (≈20 ms on the tiny model). Later updates take the direct path when
        every live parameter can be mapped to the trainer's names."""
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._fluxrl_retie_embeddings()
        self._fluxrl_inplace = self._fluxrl_plan(tensors) is not None and self._fluxrl_plan_holds(tensors)

    def _fluxrl_plan_holds(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Right after vLLM's own loader ran, the direct path would write the same values.
        Not so where the loader transforms a tensor (GPT-2's Conv1D weights are stored
        transposed, square ones included): those models keep the generic reload."""
        try:
            with torch.no_grad():
                for module, pname, parts in self._fluxrl_plan(tensors):
                    param = getattr(module, pname)
                    new = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts])
                    new = new.to(param.dtype)
                    if param.numel() == 0:
                        # Packed away by the CPU backend: compare what the layer computes
                        # with what the direct path would make it compute.
                        width = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
                        if new.dim() != 2 or new.shape[1] != width:  # never feed the kernel a wrong shape
                            return False
                        probe = torch.randn(2, new.shape[1], dtype=param.dtype)
                        got = module.quant_method.apply(module, probe)
                        if not torch.allclose(got[:, : new.shape[0]], probe @ new.T, atol=1e-4, rtol=1e-4):
                            return False
                    elif new.dim() != param.dim() or new.shape[1:] != param.shape[1:] \
                            or new.shape[0] > param.shape[0] or not torch.equal(param[: new.shape[0]], new):
                        return False
        except Exception:  # noqa: BLE001 - anything unexpected: the generic reload is always right
            return False
        return True

    def _fluxrl_plan(self, tensors: dict[str, torch.Tensor]):
        """For every vLLM parameter, the HF tensor names it is made of (fused layers such
        as qkv_proj / gate_up_proj concatenate their parts along dim 0, as at tensor
        parallel size 1). None when some parameter cannot be mapped."""
        if hasattr(self, "_fluxrl_plan_cache"):
            return self._fluxrl_plan_cache
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() != 1:  # sharded parameters: not whole tensors
            self._fluxrl_plan_cache = None
            return None
        plan = []
        for module_name, module in model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{pname}" if module_name else pname
                last = module_name.rsplit(".", 1)[-1]
                parts = [full.replace(f".{last}.", f".{p}.") for p in packed[last]] if last in packed else [full]
                if any(p not in tensors for p in parts):
                    if param is getattr(module, "weight", None) and module_name.endswith("lm_head"):
                        continue  # tied to the embedding: updated with it
                    plan = None
                    break
                plan.append((module, pname, parts))
            if plan is None:
                break
        self._fluxrl_plan_cache = plan
        return plan

    def _fluxrl_load_inplace(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy each tensor into its live parameter and, on the CPU backend, rebuild the
        packed GEMM copy that each linear layer actually multiplies with."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        written: set[int] = set()  # storages already copied into (a tied lm_head is the embedding)
        repack: dict[int, torch.nn.Module] = {}  # embedding-shaped layers whose packed copy is stale

        def joined(parts: list[str]) -> torch.Tensor:  # a fused parameter is its parts along dim 0
            return tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts])

        with torch.no_grad():
            for module, pname, parts in self._fluxrl_plan(tensors):
                param = getattr(module, pname)
                if param.numel() == 0 and cpu and pname == "weight":
                    # vLLM dropped the unpacked weight after packing it: pack the new one
                    module.weight = torch.nn.Parameter(joined(parts).to(param.dtype).contiguous(), requires_grad=False)
                    dispatch_cpu_unquantized_gemm(module, remove_weight=True)
                    continue
                if param.data_ptr() not in written:
                    written.add(param.data_ptr())
                    new = joined(parts)
                    param[: new.shape[0]].copy_(new)
                if cpu and pname == "weight" and hasattr(module, "cpu_linear") and param.dim() == 2:
                    repack[id(module)] = module
            head = getattr(self.model_runner.get_model(), "lm_head", None)
            if cpu and head is not None and hasattr(head, "cpu_linear") and head.weight.numel():
                repack[id(head)] = head  # tied: its weight changed with the embedding's
            for module in repack.values():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    def _fluxrl_retie_embeddings(self) -> None:
        # The layerwise reload loads embed_tokens but, finding no lm_head weight, puts
        # the *old* lm_head tensor back: with tied embeddings the tie is broken and the
        # output layer keeps stale weights. Copy the new embedding into it.
        model = self.model_runner.get_model()
        if not getattr(model.config, "tie_word_embeddings", False):
            return
        head, embed = getattr(model, "lm_head", None), _input_embedding(model)
        if head is None or embed is None or head.weight is embed.weight:
            return
        if hasattr(head, "cpu_linear"):  # CPU backend: lm_head runs on a repacked copy
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            head.weight = embed.weight
            dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        elif head.weight.shape == embed.weight.shape:
            with torch.no_grad():
                head.weight.copy_(embed.weight)

    def fluxrl_loaded_checksum(self) -> str | None:
        if getattr(self, "_fluxrl_checksum", None) is None and getattr(self, "_fluxrl_tensors", None) is not None:
            self._fluxrl_checksum = tensors_checksum(self._fluxrl_tensors)
        return getattr(self, "_fluxrl_checksum", None)


def _input_embedding(model):
    """The token embedding whatever the architecture calls it (Llama/Qwen ``model.embed_tokens``,
    GPT-2 ``transformer.wte``, GPT-NeoX ``gpt_neox.embed_in``): the first vocabulary
    embedding that is not the output head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                 and not isinstance(m, ParallelLMHead)), None)
