"""A neural reward model as a scoring stage (``reward.model``).

The model, a Hugging Face ``*ForSequenceClassification`` folder with one label, runs in a
worker process of its own (``python -m workers.rewards.model``, through
workers/io/local_worker.py), never in the coordinator's: its forwards do not hold the
coordinator's GIL, and a crash of the model is a named error, not a dead run loop.

``RewardModelClient.score(text)`` is awaited by each finishing sample; samples that finish
close together share a forward (micro-batches of at most ``micro_batch`` texts, a partial
one sent after ``max_wait_ms``). This is the inference stage that runs while the rest of
the rollout still generates. The worker pads each micro-batch to its longest text and
keeps the last ``max_length`` tokens of each (the completion's end is what is scored).
"""
from __future__ import annotations

import json
import logging
import math
import sys
from typing import Optional

from workers.io.local_worker import LocalWorker, LocalWorkerError, MicroBatcher, forward_in_chunks, serve, stage_env
from workers.tasks.model_folder import check_model_folder

logger = logging.getLogger(__name__)

RewardModelError = LocalWorkerError


class Scorer:
    """The model and its tokenizer, as the worker runs them (also usable in-process by
    the builder and the tests: the same tokenization, the same forward)."""

    def __init__(self, path: str, threads: int = 1, device: str = "cpu", max_tokens: int = 1 << 22):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.device = torch.device(device)  # "cuda" in a GPU plan: the GPU its CUDA_VISIBLE_DEVICES names
        check_model_folder(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # in the folder's own dtype (the planner counts it so: workers/cluster/memory.py)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, use_safetensors=True).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise RewardModelError(f"reward.model.path {path!r} has {self.model.config.num_labels} labels; a reward "
                                   "model has one (its logit is the reward)")
        pad = self.tokenizer.pad_token_id
        if pad is None:  # e.g. GPT-2: pad with EOS; the model finds each text's last real token by the mask
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.pad_id = pad
        self.model.config.pad_token_id = pad
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 1024)
        self.max_tokens = max_tokens  # inference.micro_batch_tokens: padded tokens per forward

    def ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        return ids[-self.max_length:]

    def logits(self, texts: list[str]) -> list[float]:
        seqs = [self.ids(t) or [self.pad_id] for t in texts]
        return forward_in_chunks(seqs, [len(s) for s in seqs], self.max_tokens, self._forward)

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        torch = self.torch
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():  # HF reads each row at its last token that is not the pad id
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            return [float(x) for x in logits[:, 0].float().cpu()]


class RewardModelClient:
    """Starts the worker, batches texts into its forwards and turns logits into rewards."""

    def __init__(self, spec, placement=None, max_tokens: int = 1 << 22):
        self.spec = spec  # workers.spec.RewardModelSpec, its path resolved to a folder
        # placement: its process in a GPU plan (role "inference"), None on a CPU plan;
        # max_tokens: inference.micro_batch_tokens, the padded tokens of one forward
        self.worker = LocalWorker("the reward model", "workers.rewards.model",
                                  {"path": spec.path, "threads": spec.threads,
                                   "device": "cuda" if placement else "cpu", "max_tokens": max_tokens},
                                  threads=spec.threads, timeout_s=spec.timeout_s, env=stage_env(placement))
        self.batcher = MicroBatcher(self.forward, spec.micro_batch, spec.max_wait_ms / 1000)

    def start(self) -> None:
        hello = self.worker.start()
        logger.info("reward model %s: worker pid %d, up to %d tokens per text", self.spec.path, hello["pid"],
                    hello["max_length"])

    @property
    def proc(self):
        return self.worker.proc

    @property
    def pid(self) -> Optional[int]:
        return self.worker.pid

    async def score(self, text: str) -> float:
        """The reward of one text, from the micro-batch it joins. Raises RewardModelError
        when the worker failed (every later call too: the run stops with that error)."""
        return self.reward(await self.batcher.submit(text))

    def forward(self, texts: list[str]) -> list[float]:
        """Logits of a micro-batch, through the worker (blocking)."""
        logits = self.worker.call({"texts": texts}).get("logits")
        if not isinstance(logits, list) or len(logits) != len(texts):
            raise RewardModelError("the reward model answered a micro-batch with the wrong number of scores")
        return [float(x) for x in logits]

    def reward(self, logit: float) -> float:
        if self.spec.output == "logit":
            return logit
        return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else math.exp(logit) / (1.0 + math.exp(logit))

    def stats(self) -> dict[str, float]:
        stats = self.batcher.stats()
        stats["texts"] = stats.pop("items")
        return stats

    def close(self) -> None:
        self.batcher.close()
        self.worker.close()


def _load(config: dict):
    scorer = Scorer(config["path"], config["threads"], config.get("device", "cpu"), config.get("max_tokens", 1 << 22))
    return (lambda request: {"logits": scorer.logits([str(t) for t in request["texts"]])},
            {"max_length": scorer.max_length})


if __name__ == "__main__":
    _config = json.loads(sys.argv[2])
    sys.exit(serve(int(sys.argv[1]), lambda: _load(_config)))
