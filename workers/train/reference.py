"""The KL reference as an inference stage (``algorithm.kl_reference: stage``).

RLHFuse splits RLHF's iteration into generation, inference (the reference, reward and
critic forwards) and training. Here the reference's forward leaves the trainer's step:
a worker process of its own holds the frozen reference (the run's starting model: with
``model.lora.init``, the base model with that adapter, unmerged as the trainer runs it) and
computes each sample's per-token log-probs as the sample finishes generating, in
micro-batches shared with the samples that finish close together, while the rest of the
rollout still generates. The samples reach the trainer with ``ref_logprobs`` set; the
trainer loads no reference and runs one forward less per micro-batch.

The log-probs are the trainer's own (``Trainer._logprobs``): the logits over the rollout
temperature, truncated by its top-k/top-p as vLLM sampled, in the trainer's precision
(fp32 weights under autocast for bfloat16/float16 at ZeRO 0, the spec's dtype otherwise).
On a GPU plan the worker computes on the GPU ``resources.inference_gpu`` names, and the
planner counts its weights and its forward there (workers/cluster/memory.py); a micro-batch
is split into forwards of at most ``inference.micro_batch_tokens`` padded tokens.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Optional

from workers.io.local_worker import LocalWorkerError, StageClient, forward_in_chunks, serve
from workers.spec import model_dtype
from workers.tasks.model_folder import check_model_folder

logger = logging.getLogger(__name__)


class ReferenceScorer:
    """The reference model and the trainer's log-prob rule (in the worker, or in-process)."""

    def __init__(self, path: str, dtype: str, zero_stage: int, temperature: float, top_k: int, top_p: float,
                 pad_id: int, threads: int = 1, device: str = "cpu", max_tokens: int = 1 << 22,
                 adapter: Optional[str] = None):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)  # "cuda" in a GPU plan: the GPU its CUDA_VISIBLE_DEVICES names
        # As the trainer: fp32 weights under autocast at ZeRO 0 with a low precision, else that dtype
        self.autocast = getattr(torch, dtype) if dtype != "float32" and zero_stage == 0 else None
        load = torch.float32 if self.autocast is not None else getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(check_model_folder(path), dtype=load)
        if adapter:  # model.lora.init: the starting policy; the trainer checked that it fits
            from peft import PeftModel

            # in the base weights' dtype, as the trainer's (DeepSpeed's bf16/fp16 modes cast every
            # parameter); PEFT would otherwise upcast a low-precision adapter to fp32
            model = PeftModel.from_pretrained(model, adapter, autocast_adapter_dtype=False)
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.temperature = max(temperature, 1e-5)
        self.top_k, self.top_p, self.pad_id = top_k, top_p, pad_id
        self.max_tokens = max_tokens  # inference.micro_batch_tokens: padded tokens per forward

    def logprobs(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per generated token, log π_ref(token | prefix), for (prompt_ids, token_ids) pairs."""
        return forward_in_chunks(items, [len(p) + len(t) for p, t in items], self.max_tokens, self._forward)

    def _forward(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        from workers.train.algorithms import token_logprobs
        from workers.train.batching import generated_forward

        def logits(ids, att):
            return self.model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / self.temperature

        def logprobs(out, ids):
            return token_logprobs(out, ids[:, 1:], top_k=self.top_k, top_p=self.top_p)[0]

        return generated_forward(items, self.pad_id, self.device, self.autocast, logits, logprobs)


def scorer_config(spec, model_path: str, pad_id: int, device: str = "cpu") -> dict:
    """The worker's configuration; ``device`` "cuda" when the plan gives the stage a GPU
    (the trainer's precision there: ``model_dtype`` decided for a GPU). ``adapter``: the
    model.lora.init folder, whose adapter is part of the run's starting policy (a LoRA run
    without one starts from the base model, ``model_path`` alone)."""
    ro = spec.rollout
    lora = spec.model.lora
    return {"path": model_path, "dtype": model_dtype(spec, on_gpu=device == "cuda" or None),
            "zero_stage": spec.trainer.zero_stage, "temperature": ro.temperature, "top_k": ro.top_k,
            "top_p": ro.top_p, "pad_id": pad_id, "threads": spec.inference.threads, "device": device,
            "max_tokens": spec.inference.micro_batch_tokens,
            "adapter": lora.init if lora is not None and lora.init else None}


class ReferenceStage(StageClient):
    """The coordinator's end: ``await logprobs(prompt_ids, token_ids)`` per finished sample.
    ``placement``: the plan's process for it on a GPU plan (its CUDA_VISIBLE_DEVICES), else None."""

    name, module = "the KL reference stage", "workers.train.reference"

    def __init__(self, spec, model_path: str, pad_id: int, placement=None):
        super().__init__(spec, scorer_config(spec, model_path, pad_id, "cuda" if placement else "cpu"), placement)

    async def logprobs(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        if not token_ids:
            return []
        return await self.batcher.submit((list(prompt_ids), list(token_ids)))

    def _forward(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        out = self.worker.call({"items": items}).get("logprobs")
        if not isinstance(out, list) or [len(x) for x in out] != [len(t) for _, t in items]:
            raise LocalWorkerError("the KL reference stage answered with the wrong number of log-probs")
        return out


def _load(config: dict):
    scorer = ReferenceScorer(**config)
    return (lambda request: {"logprobs": scorer.logprobs([(p, t) for p, t in request["items"]])}, {})


if __name__ == "__main__":
    _config = json.loads(sys.argv[2])
    sys.exit(serve(int(sys.argv[1]), lambda: _load(_config)))

