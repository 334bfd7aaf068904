"""Models of real published shapes, built here (nothing can be downloaded): the exact
configuration of Qwen2.5-0.5B or -1.5B (vocabulary 151,936, tied embeddings, their
layers, widths and heads) with random weights and the zoo's qwen2 tokenizer and chat
template (``python -m workers build-model qwen2 --shape qwen2.5-0.5b``).

They exist to measure what size does to FluxRL (weight transport, memory, speed), not to
learn a task: with random weights every reward is noise. The tokenizer has a few hundred
entries; the rows of the 151,936 that it never produces are there as in the published
model (whose tokenizer has 151,665)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The published configurations' shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B).
SHAPES = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
}
COMMON = {"vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 32768, "hidden_act": "silu"}
MANIFEST = "fluxrl_shape.json"


def build_shaped_model(shape: str, out_dir, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write a complete HF folder of ``shape`` (a key of SHAPES) to ``out_dir``: config,
    random bfloat16 weights (seeded), generation config, and the tokenizer and chat
    template of the folder ``tokenizer_from`` (a zoo qwen2 model), whose special ids it
    takes. Returns the folder."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    small = transformers.AutoConfig.from_pretrained(tokenizer_from)
    config = transformers.Qwen2Config(**SHAPES[shape], **COMMON, bos_token_id=small.bos_token_id,
                                      eos_token_id=small.eos_token_id, pad_token_id=small.pad_token_id)
    out = Path(out_dir)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    log.info("%s: %.1f M parameters -> %s", shape, params / 1e6, out)
    model.save_pretrained(staging, safe_serialization=True)
    del model
    for f in Path(tokenizer_from).iterdir():  # the tokenizer, chat template and generation files
        if f.is_file() and not f.name.startswith(("model", "config", "fluxrl_zoo")):
            shutil.copy(f, staging / f.name)
    (staging / MANIFEST).write_text(json.dumps({"shape": shape, "params": params, "seed": seed,
                                                "weights": "random (bfloat16)"}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def ensure_shaped_model(shape: str = "qwen2.5-0.5b") -> Path:
    """The folder of ``shape`` under the model cache ($FLUXRL_MODEL_CACHE), built once with the
    zoo's qwen2 tokenizer (the benches' real-size model)."""
    from workers.models.modelzoo import ensure_zoo_model
    from workers.models.tinymodel import default_cache

    folder = default_cache() / shape
    if not (folder / MANIFEST).exists():
        log.info("building %s's shape in %s (once)", shape, folder)
        build_shaped_model(shape, folder, ensure_zoo_model("qwen2", progress=True))
    return folder
