"""LoRA adapters of the tiny model for the engine tests: seeded, and as the weight files
the trainer sends (workers/train/lora.py)."""
import torch

from workers.weights.files import write_weight_file
from workers.weights.update import FileWeights

RANK = 8


def seeded_adapter(tiny_model_path, seed, scale=0.3, only_layer=None):
    """A PEFT model of the tiny model with a seeded adapter (B = 0 for seed None; with
    ``only_layer``, B = 0 in every other layer)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "o_proj", "down_proj"],
                                            task_type="CAUSAL_LM")).eval()
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name and (only_layer is None or f".layers.{only_layer}." in name):
                    p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def adapter_file(model, folder, version):
    from workers.train.lora import adapter_metadata, adapter_state_dict

    state = {k: v.detach() for k, v in adapter_state_dict(model).items()}
    written = write_weight_file(state, str(folder / f"adapter-v{version}.safetensors"), adapter_metadata(model))
    return FileWeights(written, adapter=True), state


def model_logprobs(model, comp):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([comp.prompt_ids + comp.token_ids])).logits[0].float().log_softmax(-1)
    n = len(comp.prompt_ids)
    return [logits[n - 1 + i, t].item() for i, t in enumerate(comp.token_ids)]
