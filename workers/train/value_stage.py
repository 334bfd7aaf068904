"""The critic's forward as an inference stage (``critic.forward: stage``).

RLHFuse's inference stage runs the reference, reward and critic forwards between
generation and training. With this stage the critic's no-grad forward (the values GAE is
computed from, and the clipped value loss's old values) leaves the trainer's step: a worker
process of its own holds a copy of the value model and computes each sample's per-token
values as the sample finishes generating, in micro-batches shared with the samples that
finish close together, while the rest of the rollout still generates. The trainer then
runs only the critic's training forwards.

The copy follows the trainer's critic: after every optimiser step (and at start-up and
after a resume) the coordinator writes the critic's full weights to a file in a private
folder and the worker loads them (``load``), between two forwards. So in a synchronous run
every sample is valued by exactly the critic the trainer would have used (tested equal);
in an asynchronous run a sample's values come from the critic of the step in which it
finished, at most as many steps behind as the sample itself (``critic_stage/lag``: the
trainer's version at the step minus the version that valued each sample, averaged).

The values are the trainer's own rule (``ValueModel``, the same precision: fp32 weights
under autocast for bfloat16/float16 at ZeRO 0, the spec's dtype otherwise). On a GPU plan
the worker computes on the GPU ``resources.inference_gpu`` names (the planner counts it there),
in forwards of at most ``inference.micro_batch_tokens`` padded tokens.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time

from workers.io.local_worker import LocalWorkerError, StageClient, forward_in_chunks, serve
from workers.spec import model_dtype
from workers.tasks.model_folder import check_model_folder

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "critic.safetensors"


class ValueScorer:
    """The value model and the trainer critic's forward rule (in the worker, or in-process)."""

    def __init__(self, path: str, dtype: str, zero_stage: int, pad_id: int, threads: int = 1, device: str = "cpu",
                 max_tokens: int = 1 << 22):
        import torch
        from transformers import AutoModel

        from workers.train.critic import ValueModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)  # "cuda" in a GPU plan: the GPU its CUDA_VISIBLE_DEVICES names
        # As the trainer's critic: fp32 weights under autocast at ZeRO 0 with a low precision, else that dtype
        self.autocast = getattr(torch, dtype) if dtype != "float32" and zero_stage == 0 else None
        load = torch.float32 if self.autocast is not None else getattr(torch, dtype)
        self.model = ValueModel(AutoModel.from_pretrained(check_model_folder(path), dtype=load)).to(self.device).eval()
        self.model.requires_grad_(False)
        self.pad_id = pad_id
        self.max_tokens = max_tokens  # inference.micro_batch_tokens: padded tokens per forward
        self.version = -1  # no weights from the trainer yet: values are refused until the first load

    def load(self, file: str, version: int) -> None:
        """The trainer critic's full weights, as ``Trainer.critic_state_dict`` wrote them."""
        from safetensors.torch import load_file

        tensors = load_file(file, device=str(self.device))
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"the critic's weights do not fit the value model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        self.version = version

    def values(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per generated token, the value before it is emitted, for (prompt_ids, token_ids) pairs."""
        if self.version < 0:
            raise RuntimeError("the critic stage has no weights from the trainer yet")
        return forward_in_chunks(items, [len(p) + len(t) for p, t in items], self.max_tokens, self._forward)

    def _forward(self, items: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        from workers.train.batching import generated_forward

        # position t values the state before token t+1
        return generated_forward(items, self.pad_id, self.device, self.autocast,
                                 lambda ids, att: self.model(ids, att)[:, :-1].float())


def scorer_config(spec, model_path: str, pad_id: int, device: str = "cpu") -> dict:
    """The worker's configuration; ``device`` "cuda" when the plan gives the stage a GPU."""
    return {"path": model_path, "dtype": model_dtype(spec, on_gpu=device == "cuda" or None),
            "zero_stage": spec.trainer.zero_stage, "pad_id": pad_id, "threads": spec.inference.threads,
            "device": device, "max_tokens": spec.inference.micro_batch_tokens}


class ValueStage(StageClient):
    """The coordinator's end: ``await values(prompt_ids, token_ids)`` per finished sample,
    ``load(state_dict, version)`` after each trainer step. ``placement``: the plan's process
    for it on a GPU plan (its CUDA_VISIBLE_DEVICES), else None."""

    name, module = "the critic stage", "workers.train.value_stage"

    def __init__(self, spec, model_path: str, pad_id: int, placement=None):
        super().__init__(spec, scorer_config(spec, model_path, pad_id, "cuda" if placement else "cpu"), placement)
        self.folder = tempfile.mkdtemp(prefix="fluxrl-critic-")  # 0700: the weights pass through here
        self.version = -1  # of the weights the worker holds
        self.loads, self.load_s = 0, 0.0

    def load(self, state_dict: dict, version: int) -> None:
        """The trainer critic's weights after step ``version`` (blocking: call it in a thread)."""
        from workers.weights.sync import serialize_state_dict

        t0 = time.perf_counter()
        path = os.path.join(self.folder, WEIGHTS_FILE)
        with open(path, "wb") as fh:
            fh.write(serialize_state_dict(state_dict))
        try:
            self.worker.call({"load": path, "version": version})
        finally:
            os.unlink(path)
        self.version = version
        self.loads += 1
        self.load_s += time.perf_counter() - t0

    async def values(self, prompt_ids: list[int], token_ids: list[int]) -> tuple[list[float], int]:
        """The sample's values, and the critic version that computed them."""
        if not token_ids:
            return [], self.version
        return await self.batcher.submit((list(prompt_ids), list(token_ids)))

    def _forward(self, items: list[tuple[list[int], list[int]]]) -> list[tuple[list[float], int]]:
        reply = self.worker.call({"items": items})
        out, version = reply.get("values"), reply.get("version")
        if not isinstance(out, list) or [len(x) for x in out] != [len(t) for _, t in items]:
            raise LocalWorkerError("the critic stage answered with the wrong number of values")
        return [(v, int(version)) for v in out]

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "loads": self.loads, "load_s": self.load_s}

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _load(config: dict):
    scorer = ValueScorer(**config)

    def handle(request: dict) -> dict:
        if "load" in request:
            scorer.load(request["load"], int(request["version"]))
            return {"version": scorer.version}
        return {"values": scorer.values([(p, t) for p, t in request["items"]]), "version": scorer.version}

    return handle, {}


if __name__ == "__main__":
    _config = json.loads(sys.argv[2])
    sys.exit(serve(int(sys.argv[1]), lambda: _load(_config)))
