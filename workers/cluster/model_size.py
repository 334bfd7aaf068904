"""A model's size for the memory planner (workers/cluster/memory.py): its exact parameter count,
from its ``config.json`` instantiated on torch's meta device, and the shapes the planner
counts activations and the KV cache with."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from workers.tasks.model_folder import check_model_folder

logger = logging.getLogger(__name__)

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSize:
    """What the planner needs of a model. ``kv_values_per_token``: K and V entries one
    token puts in the KV cache over all layers (2 x layers x KV heads x head size), when
    the config says; an upper bound for models that compress or window their cache. The
    shape (``hidden``, ``intermediate``, ``layers``, ``vocab``), when known, sizes a
    micro-batch's activations and logits."""
    params: int
    kv_values_per_token: Optional[int] = None
    largest: Optional[int] = None  # the largest tensor's elements (the embedding, as a rule)
    hidden: Optional[int] = None
    intermediate: Optional[int] = None
    layers: Optional[int] = None
    vocab: Optional[int] = None
    adapter: Optional[int] = None  # model.lora: the adapter's parameters (the only ones that train)
    saved_dtype: Optional[str] = None  # the dtype its config names (how a reward model's folder loads)
    # the largest module's own parameters (what ZeRO-3 gathers at once for a weight sync)
    largest_module: Optional[int] = None
    heads: Optional[int] = None  # attention heads
    kv_hidden: Optional[int] = None  # key/value heads x head size (= hidden without grouped K/V)
    # the decoder layer's kind, which sizes what autograd keeps of it (:func:`layer_activation_bytes`):
    # "gated" (RMSNorm, rotary attention, SwiGLU: Llama, Qwen2, Mistral) or "gpt2" (LayerNorm,
    # fused QKV, a two-matrix MLP); ``activation``: that MLP's (GPT-2's "gelu_new")
    family: Optional[str] = None
    activation: Optional[str] = None


def model_size(path: str, lora=None, head: str = "causal-lm") -> Optional[ModelSize]:
    """The model in folder ``path``: its exact parameter count (built from ``config.json``
    on the meta device: no weights read, tied embeddings counted once). None when
    ``path`` is not a model folder, or the config cannot be built (logged). ``lora``
    (``model.lora``): also the adapter's parameters, counted on the same meta model.
    ``head``: "sequence-classification" for a reward model (a score head, no LM head)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    check_model_folder(path)  # before AutoConfig reads it: a redirect is an error, not an unknown size
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForSequenceClassification if head == "sequence-classification" else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        largest = max((p.numel() for p in model.parameters()), default=0)
        largest_module = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                             default=0)
        adapter = None
        if lora is not None:
            from workers.train.lora import adapter_param_count

            adapter = adapter_param_count(model, lora)
    except Exception as exc:  # noqa: BLE001 - an architecture transformers cannot build here
        logger.warning("model %s: parameter count unknown (%s: %s); GPU memory is not checked",
                       path, type(exc).__name__, exc)
        return None
    saved = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32").replace("torch.", "")
    return ModelSize(params, _kv_values_per_token(config), largest, **_shape(config), adapter=adapter,
                     saved_dtype=saved if saved in DTYPE_BYTES else "float32", largest_module=largest_module,
                     **_layer_kind(config))


def _layer_kind(config) -> dict:
    """heads, kv_hidden, family and activation of a config (None where it does not say)."""
    config = getattr(config, "text_config", None) or config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if isinstance(hidden, int) and heads else None)
    kv_hidden = kv_heads * head_dim if isinstance(kv_heads, int) and isinstance(head_dim, int) else None
    if hasattr(config, "rms_norm_eps"):
        family, activation = "gated", getattr(config, "hidden_act", None)
    elif hasattr(config, "layer_norm_epsilon") or hasattr(config, "layer_norm_eps"):
        family = "gpt2"
        activation = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
    else:
        family = activation = None
    return {"heads": heads if isinstance(heads, int) else None, "kv_hidden": kv_hidden, "family": family,
            "activation": activation if isinstance(activation, str) else None}


def _shape(config) -> dict:
    config = getattr(config, "text_config", None) or config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) \
        or (4 * hidden if isinstance(hidden, int) else None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    vocab = getattr(config, "vocab_size", None)
    shape = {"hidden": hidden, "intermediate": intermediate, "layers": layers, "vocab": vocab}
    return {k: v if isinstance(v, int) else None for k, v in shape.items()}


def _kv_values_per_token(config) -> Optional[int]:
    config = getattr(config, "text_config", None) or config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return None
    return 2 * layers * kv_heads * head_dim
