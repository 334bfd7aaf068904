"""LoRA RL (``model.lora``, docs/guides/lora.md): PEFT's adapter on the trainer's policy.

Only the adapter trains: the base model's parameters are frozen, the optimizer is built
over the adapter's alone. What leaves the trainer for the engines is the adapter in
PEFT's own names (``get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight``),
with PEFT's adapter_config riding in the safetensors header
(``workers.weights.files.ADAPTER_CONFIG_KEY``): the rollout engines serve it as a vLLM LoRA.
The KL reference is the run's starting policy (``reference_logprobs``): with ``model.lora.init``
the init adapter, kept frozen as a second adapter on the same module (``REFERENCE``); without
it the base model, the same module with its adapters disabled.
"""
from __future__ import annotations

import enum
import json
import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from workers.spec import LoraSpec

ADAPTER = "default"  # PEFT's adapter name
REFERENCE = "reference"  # the frozen init adapter the KL reference forwards with (keep_reference_adapter)


def lora_config(lora: "LoraSpec", model_type: Optional[str] = None):
    """PEFT's LoraConfig for ``model.lora``. ``target_modules`` left out: PEFT's default for
    the architecture (``model_type``), resolved here so that the planner counts the same."""
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=resolve_target_modules(lora, model_type), bias="none",
                      task_type="CAUSAL_LM")


def resolve_target_modules(lora: "LoraSpec", model_type: Optional[str]) -> list[str]:
    if lora.target_modules:
        return list(lora.target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type or "")
    if not found:
        raise ValueError(f"model.lora.target_modules: PEFT has no default for model type {model_type!r}; "
                         "name the linear layers, e.g. [q_proj, v_proj]")
    return list(found)


def wrap(model, lora: "LoraSpec"):
    """``model`` as a PEFT model with a fresh adapter (B = 0: the policy starts as the base
    model exactly); only the adapter's parameters require gradients."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(lora, getattr(model.config, "model_type", None)))
    except ValueError as exc:  # e.g. target modules not found in the base model
        raise ValueError(f"model.lora.target_modules: {exc}") from None


def load_initial_adapter(model, lora: "LoraSpec") -> None:
    """model.lora.init: start from the adapter a PEFT folder holds (a run's
    ``final_model/adapter``, a downloaded one) instead of B = 0. Its rank, alpha and modules
    must be this spec's, and its tensors this model's (names and shapes), or a ValueError
    says which differ."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(lora.init)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"model.lora.init: {folder} is not a PEFT adapter folder (adapter_config.json and "
                         "adapter_model.safetensors)")
    saved = json.loads(config_path.read_text())
    own = model.peft_config[ADAPTER]
    targets = saved.get("target_modules")
    wrong = []
    if saved.get("r") != own.r:
        wrong.append(f"rank {saved.get('r')} (model.lora.rank is {own.r})")
    if float(saved.get("lora_alpha") or 0) != float(own.lora_alpha):
        wrong.append(f"alpha {saved.get('lora_alpha')} (model.lora.alpha is {own.lora_alpha})")
    if (set(targets) if isinstance(targets, list) else targets) != set(own.target_modules):
        wrong.append(f"target_modules {targets} (model.lora.target_modules: {sorted(own.target_modules)})")
    if wrong:
        raise ValueError(f"model.lora.init: the adapter in {folder} has " + "; ".join(wrong) + ": set model.lora "
                         "to match it")
    state = load_file(str(weights_path))
    expected = {name: t.shape for name, t in adapter_state_dict(model).items()}
    unfit = sorted(set(state) ^ set(expected)) + sorted(n for n in set(state) & set(expected)
                                                          if state[n].shape != expected[n])
    if unfit:
        raise ValueError(f"model.lora.init: {len(unfit)} of the adapter's tensors do not fit this base model (e.g. "
                         f"{unfit[0]}): an adapter of another model?")
    set_peft_model_state_dict(model, state, adapter_name=ADAPTER)


def keep_reference_adapter(model) -> None:
    """A run that starts from an adapter (model.lora.init) takes its starting policy as the KL
    reference, so that the KL is 0 at step 0 and pulls towards where the run started rather than
    towards the base model: a copy of what ``ADAPTER`` holds now (the init adapter), as a second
    adapter ``REFERENCE`` on the same module (low-rank tensors only, no second base model).
    Frozen: it requires no gradient, so the optimizer (built over ``trainable_parameters``)
    never holds it, and the policy's exports name ``ADAPTER`` alone."""
    import copy

    from peft import set_peft_model_state_dict

    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.inference_mode = True
    model.add_adapter(REFERENCE, config)
    set_peft_model_state_dict(model, adapter_state_dict(model), adapter_name=REFERENCE)
    for name, param in model.named_parameters():
        if f".{REFERENCE}." in name:
            param.requires_grad_(False)


def adapter_param_count(model, lora: "LoraSpec") -> int:
    """The adapter's parameters for ``model`` (a HF model, on the meta device will do):
    rank x (in + out) for each targeted linear layer, as PEFT builds them."""
    import torch

    targets = resolve_target_modules(lora, getattr(model.config, "model_type", None))
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            total += lora.rank * (module.in_features + module.out_features)
    return total


def trainable_parameters(model) -> list["torch.nn.Parameter"]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model) -> dict[str, "torch.Tensor"]:
    """The adapter's tensors in PEFT's saved names (what vLLM's LoRA loader reads)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def adapter_config(model) -> dict:
    """PEFT's adapter_config.json of ``model``'s adapter, as plain JSON values."""
    def plain(value):
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (set, frozenset, tuple)):
            return sorted(plain(v) for v in value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return plain(model.peft_config[ADAPTER].to_dict())


def scrub_adapter_config(folder: str) -> None:
    """PEFT writes the base model's local path into adapter_config.json: on a worker that is
    a server folder (a team's stored model), which a downloaded adapter must not reveal; the
    user names the base model when loading it (PeftModel.from_pretrained(base, folder))."""
    path = os.path.join(folder, "adapter_config.json")
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    config["base_model_name_or_path"] = None
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)


def adapter_metadata(model) -> dict[str, str]:
    """The safetensors header entries a weight file of the adapter carries."""
    from workers.weights.files import ADAPTER_CONFIG_KEY

    return {ADAPTER_CONFIG_KEY: json.dumps(adapter_config(model), sort_keys=True)}


def merged_state_dict(model) -> dict[str, "torch.Tensor"]:
    """The base model's state dict with the adapter merged in (W + scaling x B A), in the
    base model's names, computed beside the module (it keeps training unmerged)."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                deltas[f"{name}.weight"] = module.get_delta_weight(ADAPTER)
        out = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            value = value.detach().to("cpu")
            if key in deltas:
                value = (value + deltas[key].to("cpu", value.dtype))
            out[key] = value
    return out


def save_adapter(model, folder: str) -> None:
    """The policy's adapter as a PEFT folder (``ADAPTER`` alone: a frozen ``REFERENCE`` stays
    out of it), its config scrubbed of the base model's path."""
    model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False,
                          selected_adapters=[ADAPTER])
    scrub_adapter_config(folder)


def reference_logprobs(trainer, ids, att):
    """log π_ref of ``ids`` on the trainer's own module (no second copy of the model): with
    the frozen init adapter ``REFERENCE`` where the module has one (PEFT's per-row
    ``adapter_names``, which leaves the trained adapter active and every parameter's
    ``requires_grad`` as it is), else the base model, its adapters disabled."""
    import torch

    module = trainer.engine.module
    with torch.no_grad():
        if REFERENCE in module.peft_config:
            names = [REFERENCE] * ids.shape[0]
            return trainer._logprobs(lambda **inputs: module(**inputs, adapter_names=names), ids, att)
        with module.disable_adapter():
            return trainer._logprobs(module, ids, att)
