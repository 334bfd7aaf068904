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

from workers.weights.files import WeightFile, iter_weight_file, savable_tensors


def serialize_state_dict(state: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of a HF state dict (files.savable_tensors). Runs send a file
    instead (files.write_weight_file): no buffer of the whole model."""
    return st_save(savable_tensors(state))


def _host_bytes(t: torch.Tensor):
    """A tensor's values as bytes in host memory (row-major, in its dtype), as a numpy view."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)  # a 0-d tensor (a scalar buffer) cannot be viewed as bytes
    return flat.view(torch.uint8).numpy() if flat.dtype != torch.uint8 else flat.numpy()


def tensor_digest(t: torch.Tensor) -> bytes:
    """SHA-256 of one tensor's bytes."""
    return hashlib.sha256(_host_bytes(t)).digest()


def combine_digests(digests: dict[str, bytes]) -> str:
    """A state dict's checksum from its tensors' digests, by name: the same whatever order
    the tensors came in, so an engine can hash each bucket as it arrives and drop it."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return h.hexdigest()


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    return combine_digests({name: tensor_digest(t) for name, t in tensors.items()})


def legacy_tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum checkpoints recorded before ``combine_digests`` (``weights_sha256``):
    one SHA-256 over name and bytes, by name. Only to check such a checkpoint on resume."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(_host_bytes(tensors[name]))
    return h.hexdigest()


def _checked(path: str, identity: list | None, size: int | None) -> "str | WeightFile":
    """The file a worker is told to load: the path alone, or the file the server checked
    (its identity comes as a list: vLLM's RPC encodes tuples as lists)."""
    if identity is None:
        return path
    return WeightFile(path, int(size), (int(identity[0]), int(identity[1])))


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); methods are reached
    with ``engine.collective_rpc(name, args=...)``."""

    def fluxrl_load_weights(self, blob: bytes, force_reload: bool = False) -> dict:
        t0 = time.perf_counter()
        return self._fluxrl_apply(iter(st_load(blob).items()), force_reload, t0)

    def fluxrl_load_weight_file(self, path: str, force_reload: bool = False, identity: list | None = None,
                                size: int | None = None) -> dict:
        """Load a safetensors file of this host (files.WeightFile) one tensor at a time.
        ``identity`` and ``size``: the file as the engine server checked it (device and inode,
        bytes); given them, the file is read only if the path still names it."""
        t0 = time.perf_counter()
        return self._fluxrl_apply(iter_weight_file(_checked(path, identity, size)), force_reload, t0)

    def fluxrl_load_lora_file(self, path: str, folder: str, lora_id: int, lora_name: str,
                              identity: list | None = None, size: int | None = None) -> dict:
        """model.lora: serve the adapter in a weight file of this host (its tensors in PEFT's
        names, PEFT's adapter_config in the header) as vLLM LoRA ``lora_id``, replacing the
        loaded one in place (``load_inplace``): the adapter is written as a PEFT folder under
        ``folder`` (this worker's own subfolder, returned) and loaded into the LoRA slot
        between two engine steps, so the requests already running with ``lora_id`` take it
        from their next token, as a full update's weights do."""
        import json
        import os

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from workers.weights.files import ADAPTER_CONFIG_KEY, held_weight_file, weight_file_metadata

        t0 = time.perf_counter()
        # the header and the tensors from one opening of the checked file
        with held_weight_file(_checked(path, identity, size)) as readable:
            config = weight_file_metadata(readable).get(ADAPTER_CONFIG_KEY)
            if config is None:
                raise ValueError(f"{path}: not a LoRA adapter (no {ADAPTER_CONFIG_KEY} in its header)")
            self._fluxrl_digests = None
            tensors = dict(iter_weight_file(readable))
        digests = {name: tensor_digest(t) for name, t in tensors.items()}
        mine = os.path.join(folder, f"worker-{getattr(self, 'rank', 0)}")
        os.makedirs(mine, exist_ok=True)
        save_file(tensors, os.path.join(mine, "adapter_model.safetensors"))
        with open(os.path.join(mine, "adapter_config.json"), "w", encoding="utf-8") as fh:
            json.dump(json.loads(config), fh)
        self.model_runner.lora_manager.add_adapter(LoRARequest(lora_name, lora_id, mine, load_inplace=True))
        self._fluxrl_digests, self._fluxrl_checksum = digests, None
        return {"load_ms": (time.perf_counter() - t0) * 1000, "path": "lora", "folder": mine}

    # -- the collective transport (workers/weights/broadcast.py) ------------------------
    def fluxrl_join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                 backend: str = "gloo", timeout_s: float = 60.0, nccl_id: str | None = None) -> int:
        """Join the trainer's weight group (blocks until every member has); returns this
        worker's rank in it. A previous group is dropped (it is broken, or replaced)."""
        from workers.weights.weight_group import WeightGroup

        old = getattr(self, "_fluxrl_group", None)
        self._fluxrl_group = None
        if old is not None:
            old.close()
        rank = rank_offset + int(getattr(self, "rank", 0) or 0)
        self._fluxrl_group = WeightGroup(host, port, rank, world_size, backend, timeout_s,
                                         device=getattr(self, "device", None), nccl_id=nccl_id)
        return rank

    def fluxrl_receive_weights(self, meta: dict, force_reload: bool = False) -> dict:
        """Receive the state dict ``meta`` describes from the trainer's broadcast and load it
        as it arrives, bucket by bucket (no copy of the model is held: GPU-ready memory).
        ``recv_ms``: the time spent waiting for bytes; ``load_ms`` includes it (generation
        cannot run during either)."""
        group = getattr(self, "_fluxrl_group", None)
        if group is None:
            raise RuntimeError("this engine is not in a weight group (fluxrl_join_weight_group first)")
        t0 = time.perf_counter()
        waited = [0.0]

        def timed(stream):
            while True:
                t = time.perf_counter()
                try:
                    item = next(stream)
                except StopIteration:
                    waited[0] += time.perf_counter() - t
                    return
                waited[0] += time.perf_counter() - t
                yield item

        stream = group.receive_stream(meta)
        try:
            result = self._fluxrl_apply(timed(stream), force_reload, t0, digest=bool(meta.get("digest")))
            for _ in stream:  # a loader that left names unread: the collective still has to finish
                pass
        finally:
            stream.close()
        return {**result, "recv_ms": waited[0] * 1000}

    def _fluxrl_apply(self, items, force_reload: bool, t0: float, digest: bool = True) -> dict:
        """Load (name, tensor) pairs from ``items``, hashing each one as it passes (host
        tensors always; device ones only when ``digest``: a copy to the host is not free),
        so the checksum needs no copy of the weights. Every update streams: the first goes
        through vLLM's reload, keeping a few rows of each tensor (:func:`_head_rows`) to
        decide whether later ones may take the direct path (no copy of the model: a model
        that fills its GPU loads its first update as it loads any)."""
        digests: dict = {}
        hashed = [True]

        def hashing():
            for name, tensor in items:
                if hashed[0] and (digest or tensor.device.type == "cpu"):
                    digests[name] = tensor_digest(tensor)
                else:
                    hashed[0] = False
                yield name, tensor

        self._fluxrl_digests = None  # the old weights' checksum no longer holds, whatever happens
        decided = getattr(self, "_fluxrl_inplace", None)
        if decided is None:
            heads: dict[str, tuple[torch.Size, torch.Tensor]] = {}

            def sampling(stream):
                for name, tensor in stream:
                    heads[name] = (tensor.shape, _head_rows(tensor))
                    yield name, tensor

            self._fluxrl_reload(sampling(hashing()))
            self._fluxrl_inplace = self._fluxrl_plan(heads) is not None and self._fluxrl_plan_holds(heads)
            path = "reload"
        elif decided and not force_reload:
            self._fluxrl_load_inplace(hashing())
            path = "direct"
        else:
            self._fluxrl_reload(hashing())
            path = "reload"
        self._fluxrl_digests, self._fluxrl_checksum = (digests if hashed[0] else None), None
        return {"load_ms": (time.perf_counter() - t0) * 1000, "path": path}

    def _fluxrl_reload(self, items) -> None:
        """vLLM's layerwise reload: generic, but it re-runs every layer's post-load
        processing (≈20 ms on the tiny model). Later updates take the direct path when
        every live parameter can be mapped to the trainer's names. vLLM's loader reads
        ``items`` as it goes (it streams checkpoints from disk the same way)."""
        self.reload_weights(weights_iterator=items, is_checkpoint_format=True)
        self._fluxrl_retie_embeddings()

    def _fluxrl_plan_holds(self, heads: dict[str, tuple[torch.Size, torch.Tensor]]) -> bool:
        """Right after vLLM's own loader ran, the direct path would write the same values.
        Not so where the loader transforms a tensor (GPT-2's Conv1D weights are stored
        transposed, square ones included): those models keep the generic reload. Checked
        on the first rows of every part (``heads``: shape, first rows), where a
        transposition or permutation of random weights shows, without a copy of the model."""
        try:
            with torch.no_grad():
                for module, pname, parts in self._fluxrl_plan(heads):
                    param = getattr(module, pname)
                    shapes = [heads[p][0] for p in parts]
                    if any(len(sh) == 0 or sh[1:] != shapes[0][1:] for sh in shapes):
                        return False  # a scalar, or parts that do not stack
                    rows, offset = sum(shape[0] for shape in shapes), 0
                    for part, shape in zip(parts, shapes):
                        head = heads[part][1].to(param.dtype)
                        if param.numel() == 0:
                            # Packed away by the CPU backend: compare what the layer computes
                            # with what the direct path would make it compute.
                            width = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
                            if head.dim() != 2 or head.shape[1] != width:  # never feed the kernel a wrong shape
                                return False
                            probe = torch.randn(2, head.shape[1], dtype=param.dtype)
                            got = module.quant_method.apply(module, probe)
                            if not torch.allclose(got[:, offset: offset + head.shape[0]], probe @ head.T,
                                                  atol=1e-4, rtol=1e-4):
                                return False
                        elif len(shape) != param.dim() or shape[1:] != param.shape[1:] or rows > param.shape[0] \
                                or not torch.equal(param[offset: offset + head.shape[0]], head):
                            return False
                        offset += shape[0]
        except Exception:  # noqa: BLE001 - anything unexpected: the generic reload is always right
            return False
        return True

    def _fluxrl_plan(self, tensors):
        """For every vLLM parameter, the HF tensor names it is made of (fused layers such
        as qkv_proj / gate_up_proj concatenate their parts along dim 0, as at tensor
        parallel size 1). None when some parameter cannot be mapped. ``tensors``: keyed by
        the update's names (only membership is asked)."""
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

    def _fluxrl_load_inplace(self, items) -> None:
        """Copy each tensor into its live parameter as it arrives (a fused parameter once all
        its parts have), letting go of it once every parameter made of it is written, and,
        on the CPU backend, rebuild the packed GEMM copy that each linear layer actually
        multiplies with."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        plan = self._fluxrl_plan_cache  # decided on the first update: the direct path has one
        waiting: dict[str, list[int]] = {}  # HF name -> the plan entries it is a part of
        for k, (_, _, parts) in enumerate(plan):
            for part in parts:
                waiting.setdefault(part, []).append(k)
        missing = [len(parts) for _, _, parts in plan]
        pending: dict[str, torch.Tensor] = {}
        uses = {name: len(entries) for name, entries in waiting.items()}
        written: set[int] = set()  # storages already copied into (a tied lm_head is the embedding)
        repack: dict[int, torch.nn.Module] = {}  # embedding-shaped layers whose packed copy is stale

        def write(module, pname: str, parts: list[str]) -> None:
            param = getattr(module, pname)
            new = pending[parts[0]] if len(parts) == 1 else torch.cat([pending[p] for p in parts])
            check_update_shape(parts, new, module, pname)
            if param.numel() == 0 and cpu and pname == "weight":
                # vLLM dropped the unpacked weight after packing it: pack the new one
                module.weight = torch.nn.Parameter(new.to(param.dtype).contiguous(), requires_grad=False)
                dispatch_cpu_unquantized_gemm(module, remove_weight=True)
                return
            if param.data_ptr() not in written:
                written.add(param.data_ptr())
                param[: new.shape[0]].copy_(new)
            if cpu and pname == "weight" and hasattr(module, "cpu_linear") and param.dim() == 2:
                repack[id(module)] = module

        with torch.no_grad():
            for name, tensor in items:
                if name not in waiting:
                    continue  # nothing live is made of it (as vLLM's loader skips it)
                pending[name] = tensor
                for k in waiting[name]:
                    missing[k] -= 1
                    if missing[k] == 0:
                        module, pname, parts = plan[k]
                        write(module, pname, parts)
                        for part in parts:
                            uses[part] -= 1
                            if uses[part] == 0:
                                del pending[part]  # the receive's bucket can go
            unwritten = [".".join(plan[k][2]) for k, left in enumerate(missing) if left]
            if unwritten:
                raise RuntimeError(f"the weight update lacks tensors for {len(unwritten)} parameters, "
                                   f"e.g. {unwritten[0]}: the engine now holds a mix of versions")
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
        """``tensors_checksum`` of the last update as it arrived; None before any update, or
        when it came on a device without being asked to be hashed."""
        if getattr(self, "_fluxrl_checksum", None) is None and getattr(self, "_fluxrl_digests", None) is not None:
            self._fluxrl_checksum = combine_digests(self._fluxrl_digests)
        return getattr(self, "_fluxrl_checksum", None)


HEAD_ROWS = 4  # rows of each tensor the first update keeps to check the direct path
HEAD_VALUES = 256  # values of a 1-D tensor it keeps


def check_update_shape(parts: list[str], new: torch.Tensor, module: torch.nn.Module, pname: str) -> None:
    """Raise unless ``new`` (the update's tensors ``parts``, concatenated) fits the live
    parameter ``pname`` of ``module`` that the direct path copies it into: a copy into a
    slice would take a wrong-shaped tensor silently (an empty one copies nothing). The same
    shape, but for a vocabulary embedding padded to more rows (``num_embeddings_padded``),
    which takes at most its rows; a weight the CPU backend packed away (empty) is checked
    against the layer's sizes."""
    param = getattr(module, pname)
    got = tuple(new.shape)
    if param.numel() == 0 and pname == "weight":
        sizes = (getattr(module, "output_size_per_partition", None), getattr(module, "input_size_per_partition", None))
        want = sizes if None not in sizes else None
        fits = len(got) == 2 and (want is None or got == want)
    else:
        want = tuple(param.shape)
        padded = hasattr(module, "num_embeddings_padded") and len(got) == len(want) > 0
        fits = got == want or (padded and 0 < got[0] <= want[0] and got[1:] == want[1:])
    if not fits:
        raise ValueError(f"weight update: tensor {'+'.join(parts)} has shape {got}, the engine's parameter "
                         f"expects {want if want is not None else '2-D'}"
                         f"{' (rows at most)' if hasattr(module, 'num_embeddings_padded') else ''}; the "
                         "tensors before it in the update are loaded already: the engine holds a mix of versions")


def _head_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's first rows (a 1-D one's first values; a scalar itself), copied to the host."""
    t = tensor.detach()
    head = t.reshape(()) if t.dim() == 0 else t[: HEAD_VALUES if t.dim() == 1 else HEAD_ROWS]
    return head.to("cpu", copy=True)


def _input_embedding(model):
    """The token embedding whatever the architecture calls it (Llama/Qwen ``model.embed_tokens``,
    GPT-2 ``transformer.wte``, GPT-NeoX ``gpt_neox.embed_in``): the first vocabulary
    embedding that is not the output head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    return next((m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                 and not isinstance(m, ParallelLMHead)), None)
