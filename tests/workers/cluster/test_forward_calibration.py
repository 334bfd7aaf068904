"""The trainer's forward as the planner counts it (workers/cluster/memory.py ``forward_memory``),
against what a real HF forward and backward of the zoo's architectures keeps on this CPU, at a
real-size vocabulary (100,352) and 2,048 tokens a micro-batch (two rows, one padded, as packed
micro-batches are), with the trainer's own loss path (``Trainer._logprobs``: the logits over the
temperature, ``token_logprobs`` with the entropy, ``truncated_logits`` under top-p).

- Activations: the bytes of every tensor autograd saves in the model's body
  (``torch.autograd.graph.saved_tensors_hooks``, each storage once; parameters and autocast's
  weight copies are the planner's weights and ``cast_gib``, not counted here).
- Logits: the peak of the live vocabulary-sized tensors from the LM head's output to the end
  of the backward (a dispatch mode watching each storage's lifetime).

Each term, and their sum, within 15% of the plan. Hidden sizes are tiny so that it runs in
seconds; the per-layer formulas are exercised over several widths in
``test_layer_formula_tracks_the_widths``."""
import contextlib
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from workers.cluster.model_size import GIB, model_size
from workers.cluster.trainer_memory import forward_memory
from workers.train import algorithms

VOCAB = 100_352
TOKENS = 2048
ROWS = 2


def _config(arch: str, hidden: int, inter: int, heads: int, kv_heads: int, layers: int, vocab: int) -> dict:
    if arch == "gpt2":  # the zoo's gpt2: learned positions, LayerNorm, gelu_new MLP, no dropout
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": hidden, "n_inner": inter,
                "n_layer": layers, "n_head": heads, "n_positions": 4096, "vocab_size": vocab,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
                "bos_token_id": 0, "eos_token_id": 0}
    cls = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    return {"architectures": [cls], "model_type": arch, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": hidden // heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "tie_word_embeddings": False}


class _LivePeak(TorchDispatchMode):
    """The peak bytes of live storages of at least ``floor`` bytes made under it."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor, self.live, self.peak = floor, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= self.floor:
                storage = t.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _weight_copy(t: torch.Tensor) -> bool:
    """A cast (or its transpose) of a parameter: autocast's weight copies."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None or type(fn).__name__ not in ("TBackward0", "ToCopyBackward0", "PermuteBackward0"):
            return False
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
        if fn is not None and type(fn).__name__ == "AccumulateGrad":
            return True
    return False


def measure(tmp_path, arch, precision, hidden=64, inter=192, heads=2, kv_heads=1, layers=2, vocab=VOCAB,
            top_p=1.0, logits=True, tokens=TOKENS):
    """(activations GiB, logits GiB or None, the model's ModelSize) of one training forward and backward."""
    import transformers

    folder = tmp_path / f"{arch}-{precision}-{hidden}-{inter}-{heads}-{kv_heads}-{vocab}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config(arch, hidden, inter, heads, kv_heads, layers, vocab)))
    size = model_size(str(folder))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    model.to(torch.bfloat16 if precision == "mixed" else torch.float32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, saved, body = set(), [0], [True]
    model.get_output_embeddings().register_forward_pre_hook(lambda *_: body.__setitem__(0, False))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if body[0] and key not in seen and key not in params and not _weight_copy(t):
            saved[0] += t.untyped_storage().nbytes()
        seen.add(key)
        return t

    length = tokens // ROWS
    ids = torch.randint(0, vocab, (ROWS, length), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[1:, length - length // 8:] = 0
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    peak = _LivePeak(ROWS * (length - 1) * vocab) if logits else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with peak:
            with cast:
                out = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / 0.9
            logp, entropy = algorithms.token_logprobs(out, ids[:, 1:], top_p=top_p, with_entropy=True)
            del out
            loss = -(logp * att[:, 1:]).sum() - 0.01 * (entropy * att[:, 1:]).sum()
            if logits:
                loss.backward()
    return saved[0] / GIB, (peak.peak / GIB if logits else None), size


DTYPE_STAGE = {"mixed": ("bfloat16", 2), "autocast": ("bfloat16", 0), "fp32": ("float32", 0)}


def planned(size, precision, truncated=False, tokens=TOKENS):
    dtype, stage = DTYPE_STAGE[precision]
    return forward_memory(size, tokens, dtype, stage, row=tokens // ROWS, truncated=truncated)


def close(plan, measured):
    return abs(plan - measured) <= 0.15 * measured


def test_qwen2_bf16_at_a_real_vocabulary_each_term_and_the_total_within_15_percent(tmp_path):
    activations, logits, size = measure(tmp_path, "qwen2", "mixed")
    plan_act, plan_logits = planned(size, "mixed")
    assert close(plan_act, activations), (plan_act, activations)
    assert close(plan_logits, logits), (plan_logits, logits)
    assert close(plan_act + plan_logits, activations + logits), (plan_act + plan_logits, activations + logits)


def test_top_p_truncation_at_a_real_vocabulary_within_15_percent(tmp_path):
    # truncated_logits' cost is per entry (its sort is per row): measured on fewer rows of the same
    # vocabulary, since sorting 2,048 x 100,352 entries takes this CPU most of a minute
    tokens = 512
    activations, logits, size = measure(tmp_path, "qwen2", "mixed", top_p=0.9, tokens=tokens)
    plan_act, plan_logits = planned(size, "mixed", truncated=True, tokens=tokens)
    assert close(plan_logits, logits), (plan_logits, logits)
    assert close(plan_act + plan_logits, activations + logits), (plan_act + plan_logits, activations + logits)


@pytest.mark.parametrize("arch,precision", [("llama", "autocast"), ("qwen2", "fp32"), ("gpt2", "mixed"),
                                            ("gpt2", "autocast"), ("gpt2", "fp32")])
def test_activations_by_architecture_and_precision_within_15_percent(tmp_path, arch, precision):
    # the logits' cost per entry is the same in every precision (fp32 from .float() on)
    activations, _, size = measure(tmp_path, arch, precision, heads=2, kv_heads=2 if arch == "gpt2" else 1,
                                   vocab=1024, logits=False)
    plan_act, _ = planned(size, precision)
    assert close(plan_act, activations), (plan_act, activations)


@pytest.mark.parametrize("hidden,inter,heads,kv_heads", [(128, 192, 4, 1), (64, 384, 2, 2), (256, 256, 8, 2)])
def test_layer_formula_tracks_the_widths(tmp_path, hidden, inter, heads, kv_heads):
    for precision in ("mixed", "autocast"):
        activations, _, size = measure(tmp_path, "qwen2", precision, hidden, inter, heads, kv_heads, layers=1,
                                       vocab=512, logits=False)
        plan_act, _ = planned(size, precision)
        assert close(plan_act, activations), (precision, plan_act, activations)
