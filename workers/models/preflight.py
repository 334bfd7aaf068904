"""A run's model and data, checked before any process starts: every refusal here names
what is wrong and how to fix it, and costs seconds instead of an engine start-up.

- ``model.path``: a folder with ``config.json``, or a hub id found in the local Hugging
  Face cache (nothing is downloaded);
- an architecture vLLM generates with;
- a tokenizer, whose vocabulary fits the model's embedding rows;
- chat rows only with a chat template;
- prompt + ``rollout.max_tokens`` within ``max_model_len``: longer prompts are skipped,
  counted and reported; a run left with no training prompt is refused.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field

from workers.tasks.prompts import PromptError, PromptRenderer, load_tokenizer, stop_token_ids
from workers.tasks.template_child import CHAT_TEMPLATE

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelCheckError(ValueError):
    """The model or data cannot run (bad input: exit code 2)."""


# model.path names the engine builds (or installs from workers/assets) itself
BUILTIN_MODELS = ("builtin:tiny", "builtin:qwen2-tools")


def resolve_model_path(path: str) -> str:
    """``builtin:tiny``, ``builtin:qwen2-tools`` (workers/models/toolzoo.py), a local folder, or a hub id
    with a local copy in the HF cache."""
    if path == "builtin:tiny":
        from workers.models.tinymodel import ensure_tiny_model

        return str(ensure_tiny_model())
    if path == "builtin:qwen2-tools":
        from workers.models.toolzoo import ensure_tool_model

        return str(ensure_tool_model())
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelCheckError(f"model.path {path!r} is not a Hugging Face model folder (no config.json there)")
        return path
    if _HUB_ID.match(path) and not os.path.exists(path):
        from huggingface_hub import constants, snapshot_download

        try:  # the cache folder read now: HF_HOME / HF_HUB_CACHE as this process has them
            return snapshot_download(repo_id=path, local_files_only=True, cache_dir=constants.HF_HUB_CACHE)
        except Exception:  # noqa: BLE001 - not in the cache (LocalEntryNotFoundError and kin)
            raise ModelCheckError(
                f"model.path {path!r} looks like a Hugging Face hub id, and this machine has no local copy of it "
                f"(looked in {constants.HF_HUB_CACHE}); FluxRL never downloads during a run. Download it where there is network "
                f"(`huggingface-cli download {path}`) and copy the cache here under $HF_HOME (or set HF_HOME to it), "
                "or give the model folder's path") from None
    raise ModelCheckError(f"model.path {path!r} does not exist (a model folder, or a hub id in the local HF cache)")


def _generation_architectures() -> set[str]:
    """The architectures vLLM generates with, read from its registry's source (40 ms) rather
    than by importing vLLM (7 s or more on 2 cores): the coordinator itself never needs vLLM
    when the engines run as servers. Another layout of vLLM falls back to the import."""
    names = _registry_names("_TEXT_GENERATION_MODELS")
    return names if names else _imported_generation_architectures()


def _registry_names(table: str) -> set[str]:
    import ast
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm")
        path = os.path.join(os.path.dirname(found.origin), "model_executor", "models", "registry.py")
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == table for t in targets) and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _imported_generation_architectures() -> set[str]:
    from vllm import ModelRegistry

    try:
        from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

        return set(_TEXT_GENERATION_MODELS) & set(ModelRegistry.get_supported_archs())
    except ImportError:  # another vLLM layout: every architecture it knows
        return set(ModelRegistry.get_supported_archs())


def model_limit(config: dict) -> int | None:
    """Positions the model was built for (None when its config does not say)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


@dataclass
class Checked:
    model_path: str
    renderer: PromptRenderer
    stop_ids: list[int]
    pad_id: int
    max_model_len: int  # the engines' limit: what the longest kept prompt needs
    train_rows: list[dict]
    eval_rows: list[dict]
    skipped: dict[str, int] = field(default_factory=dict)  # "train"/"eval" -> prompts too long


def check_run(spec, train_rows: list[dict], eval_rows: list[dict], check_architecture: bool = True) -> Checked:
    path = spec.model.path
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    archs = config.get("architectures") or []
    if check_architecture:
        supported = _generation_architectures()
        if not archs or not any(a in supported for a in archs):
            raise ModelCheckError(f"model.path {path!r}: architecture {', '.join(archs) or '(none in config.json)'} "
                                  "is not one vLLM generates with (see vLLM's supported models list)")
    try:
        tokenizer = load_tokenizer(path)
    except PromptError as exc:
        raise ModelCheckError(str(exc)) from None
    rows_vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if rows_vocab and len(tokenizer) > rows_vocab:
        raise ModelCheckError(f"model.path {path!r}: the tokenizer has {len(tokenizer)} tokens but the model only "
                              f"{rows_vocab} embedding rows (config.json vocab_size): they are not a pair "
                              "(resize the embeddings, or use the tokenizer the model was trained with)")
    renderer = PromptRenderer.for_task(tokenizer, spec.task)
    stops = stop_token_ids(path, tokenizer)
    if not stops:
        logger.warning("model %s declares no end-of-sequence id: every completion runs to rollout.max_tokens", path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)

    limit = model_limit(config)
    wanted = spec.rollout.max_model_len
    if wanted and limit and wanted > limit:
        raise ModelCheckError(f"rollout.max_model_len {wanted} exceeds the model's {limit} positions")
    cap = wanted or limit or 1_000_000
    budget = spec.rollout.max_tokens
    if budget >= cap:
        raise ModelCheckError(f"rollout.max_tokens {budget} leaves no room for a prompt within "
                              f"max_model_len {cap}" + ("" if wanted else " (the model's limit)"))

    # Every row's prompt in one bounded child (workers.tasks.template_child): the spec's
    # template and the model's chat template are user input, rendered nowhere else.
    try:
        renderer.prepare(train_rows + eval_rows)
    except PromptError as exc:
        raise ModelCheckError(f"model.path {path!r}: {exc}" if exc.source == CHAT_TEMPLATE
                              else f"task.dataset: {exc}") from None

    def keep(rows: list[dict]) -> tuple[list[dict], int]:
        kept = []
        for row in rows:
            try:
                n = len(renderer.ids(row))
            except PromptError as exc:
                raise ModelCheckError(f"task.dataset: {exc}") from None
            if n + budget <= cap:
                kept.append(row)
        return kept, len(rows) - len(kept)

    train, skipped_train = keep(train_rows)
    evals, skipped_eval = keep(eval_rows)
    if not train:
        raise ModelCheckError(f"every training prompt is too long: prompt + rollout.max_tokens ({budget}) exceeds "
                              f"max_model_len {cap}; raise rollout.max_model_len or lower rollout.max_tokens")
    if skipped_train or skipped_eval:
        logger.warning("skipped %d training and %d held-out prompts longer than max_model_len %d - "
                       "rollout.max_tokens %d", skipped_train, skipped_eval, cap, budget)
    longest = max(len(renderer.ids(r)) for r in train + evals)
    # an episode (task.environment) holds its turns and observations in the context too
    env = spec.task.environment
    context = max(budget, env.max_episode_tokens) if env is not None else budget
    return Checked(path, renderer, stops, pad, min(cap, longest + context), train, evals,
                   {"train": skipped_train, "eval": skipped_eval})
