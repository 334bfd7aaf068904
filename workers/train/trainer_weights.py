"""The trainer's weights and checkpoints: the full state dicts that leave it (for the rollout
engines, whatever the ZeRO stage), the weight file, the HF folder it saves, and DeepSpeed's
own checkpoint. A mixin of ``Trainer`` (workers/train/trainer.py), whose engine, critic,
LoRA config and autocast dtype it reads."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from workers.spec import model_dtype
from workers.train.deepspeed_internals import gathered_state_dict

if TYPE_CHECKING:
    from workers.weights.files import WeightFile


class TrainerWeights:
    # -- weights -----------------------------------------------------------------
    def state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full tensors, on the CPU, whatever the ZeRO stage: under ZeRO-3 each rank holds
        only its shard (the module's parameters are empty placeholders), so they are
        gathered first, module by module (:func:`gathered_state_dict`). Every rank must
        call this (the gather is a collective); ``keep`` False: take part, keep nothing
        (the ranks whose copy nobody reads)."""
        module = self.engine.module
        if self.lora is not None:  # what the engines load: the adapter alone (ZeRO-3 is refused with it)
            from workers.train.lora import adapter_state_dict

            return {k: v.detach().to("cpu", self.autocast_dtype if self.autocast_dtype is not None
                                     and v.dtype == torch.float32 else v.dtype)
                    for k, v in adapter_state_dict(module).items()}
        if self.spec.trainer.zero_stage == 3:
            return gathered_state_dict(module, keep)
        if self.autocast_dtype is not None:
            # fp32 parameters under autocast: what leaves is in model.dtype, as the engines load it
            return {k: v.detach().to("cpu", self.autocast_dtype if v.dtype == torch.float32 else v.dtype)
                    for k, v in module.state_dict().items()}
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def critic_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The critic's full tensors on the CPU, in the dtype it trains in (the critic stage's
        copy computes what this one would). Every rank must call this under ZeRO-3."""
        module = self.critic.engine.module
        if self.spec.critic.zero_stage == 3:
            return gathered_state_dict(module, keep)
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def weight_metadata(self) -> dict[str, str]:
        """The header entries of the weight file ``state_dict`` is written to: with model.lora
        PEFT's adapter_config, which the engines need to serve the adapter."""
        if self.lora is None:
            return {}
        from workers.train.lora import adapter_metadata

        return adapter_metadata(self.engine.module)

    def write_weight_file(self, path: str) -> "WeightFile":
        """The weights the engines load (``state_dict``) as a safetensors file at ``path``,
        with ``weight_metadata`` in its header (files.WeightWriter)."""
        from workers.weights.files import write_weight_file

        return write_weight_file(self.state_dict(), path, self.weight_metadata() or None)

    def save(self, path: str) -> None:
        """A complete HF folder (weights + the tokenizer files) that vLLM can load. With
        model.lora: the base model with the adapter merged in, and the adapter itself as a
        PEFT folder in ``adapter/``."""
        import shutil

        if self.lora is not None:
            from workers.train.lora import merged_state_dict

            module = self.engine.module
            state = merged_state_dict(module)
            if self.autocast_dtype is not None:
                state = {k: v.to(self.autocast_dtype) if v.dtype == torch.float32 else v for k, v in state.items()}
            module.get_base_model().save_pretrained(path, state_dict=state, safe_serialization=True)
            from workers.train.lora import save_adapter

            save_adapter(module, os.path.join(path, "adapter"))
        else:
            state = self.state_dict()
            self.engine.module.save_pretrained(path, state_dict=state, safe_serialization=True)
        if self.autocast_dtype is not None:  # save_pretrained wrote the fp32 module's dtype
            import json

            with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
                cfg = json.load(fh)
            cfg["dtype"] = model_dtype(self.spec)
            with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(cfg, fh, indent=2, sort_keys=True)
        for name in os.listdir(self.model_path):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens",
                                "spiece", "sentencepiece")):
                shutil.copy(os.path.join(self.model_path, name), path)

    # -- checkpoints (workers/io/checkpoint.py) ------------------------------------------
    # DeepSpeed's own checkpoint: module, optimiser (whatever wraps it at this ZeRO stage
    # and dtype) and scheduler states, restored exactly by load_state.
    def save_state(self, folder: str) -> None:
        self.engine.save_checkpoint(folder, tag="ds", client_state={"fluxrl_version": self.version},
                                    save_latest=False)
        if self.critic is not None:
            self.critic.save_state(folder)

    def load_state(self, folder: str) -> int:
        """Restore a save_state folder; returns (and takes) the policy version saved."""
        path, client = self.engine.load_checkpoint(folder, tag="ds", load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
        self.version = int(client["fluxrl_version"])
        if self.critic is not None:
            self.critic.load_state(folder)
        return self.version
