"""GPU memory of a placement plan, counted before anything starts.

:func:`plan_memory` lays what each process of a GPU plan holds on each GPU it uses and
:meth:`MemoryPlan.problem` names the first GPU that overflows (None when all fit);
``workers/cluster/placement.py`` raises it as a ``PlacementError``. Pure arithmetic
over the spec, the plan and the model's size (:func:`model_size`: the exact parameter
count from the model's ``config.json``, instantiated on torch's meta device). What is
counted, per GPU, and where it comes from:

- **Trainer rank** (:func:`trainer_memory`: DeepSpeed 0.19.8 under the config
  ``workers.train.deepspeed_setup.deepspeed_config`` gives it, torch AdamW): weights, gradients,
  the fp32 master copy and Adam's two moments, partitioned as ZeRO does (stage 1 the
  master copy and moments, 2 also the gradients, 3 also the weights), and the largest of
  the transients: the fp32 gradients flattened at the optimizer step, under ZeRO-3 the
  largest module's weights gathered for a weight sync (``Trainer.state_dict`` gathers one
  module's own parameters at a time), under autocast the low-precision weight copies the forward keeps
  for the backward.
- **KL reference** (``algorithm.kl_coef > 0``, in the trainer): a full copy on every trainer
  GPU, in the dtype the policy was loaded in (fp32 under autocast; ``Trainer.__init__`` moves
  it to the rank's device, ZeRO never shards it).
- **The inference stage's workers** (``reward.model``, ``kl_reference: stage``,
  ``critic.forward: stage``; :func:`inference_items`), on the GPU ``resources.inference_gpu``
  names: a CUDA context each (``STAGE_RUNTIME_GIB``, estimated), the model (the reference and
  the critic's copy as the trainer loads them, the reward model in its folder's dtype) and,
  while the rollout generates, one no-grad forward of ``inference.micro_batch_tokens`` tokens
  (:func:`inference_forward_gib`; the reference's with its full-vocabulary logits).
- **Engine** (vLLM): ``gpu_memory_utilization`` x the GPU's memory, all of it: vLLM
  requests that share at start-up and sizes its KV cache to fill what its weights
  (split over ``tensor_parallel``) and activations leave of it
  (vllm/v1/worker/utils.py ``request_memory``, gpu_worker.py ``determine_available_memory``).
  Anything else on that GPU must fit in the rest. The weights must leave room in the
  share, and with ``rollout.max_model_len`` set, room for one such sequence's KV cache
  (what vLLM's v1/core/kv_cache_utils.py ``_check_enough_kv_cache_memory`` demands).
- **Weight-receive buffers** (``rollout.weight_transport: collective``, outside vLLM's
  share): ``WeightGroup.receive_stream`` posts the next bucket while the current one is
  copied into the parameters, so an engine GPU holds two buckets at a time, each
  ``broadcast.BUCKET_BYTES`` or the largest tensor, whichever is larger (a tensor larger
  than a bucket travels alone). ``rpc`` receives in host memory.

Colocated plans (the engines on the trainer's GPUs) are counted in two phases, since the
engines sleep through each trainer step (vLLM sleep level 1: weights to host memory, KV
cache freed; ``RolloutEngine.sleep``): *generating* (the trainer's weights, gradients and
optimizer states, the reference, and the engines' share) and *training* (the trainer's
all, transients included, and the reference; the engines hold nothing), and between the
two *updating* (the engines' weights awake, their KV cache still asleep, the receive
buffers; the trainer's persistent states and, under ZeRO-3, its largest module gathered).

Also per trainer rank: its **CUDA context and runtime buffers** (cuBLAS, NCCL, DeepSpeed's
buckets: ``RUNTIME_GIB``, measured), the **critic** (``algorithm.advantage: gae``: a second
model with its own DeepSpeed engine at ``critic.zero_stage``), and, as the largest transient
beside the optimizer step's and ZeRO-3's gather, the **largest micro-batch's activations and
its logits at the full vocabulary** (:func:`forward_memory`: what autograd keeps of each layer,
by architecture and precision, and the logits' peak with the entropy and, with top-p/top-k,
the truncation; the forward is ``trainer.micro_batch_tokens``, or the longest sequence where
that is longer: :func:`forward_tokens`). Each term is checked within 15% of what a real HF
forward and backward keeps on the CPU at a 100k vocabulary and 2,048 tokens
(``tests/workers/cluster/test_forward_calibration.py``), and the rank's total within 25% of
the peaks measured on an H200 (docs/benchmarks.md, "On a GPU"; ``test_memory_plan.py``).

Not counted (they come on top): the critic's own activations (its forward and backward
come after the policy's), the trainer's send buckets (a few x 32 MiB), what a sleeping
engine keeps (its CUDA context and graphs). vLLM's sampling buffers and activations are
inside its share (it profiles them at start-up).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from workers.tasks.model_folder import check_model_folder
from workers.spec import model_dtype
from workers.weights.broadcast import BUCKET_BYTES

if TYPE_CHECKING:
    from workers.spec import RunSpec

logger = logging.getLogger(__name__)

GIB = 2**30
# The inference stage's workers, by the names the plan, the logs and result.json give them
REWARD_MODEL, REFERENCE_STAGE, CRITIC_STAGE = "reward model", "KL reference stage", "critic stage"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_TEMPORARY_BYTES = 4  # per parameter updated: torch's multi-tensor AdamW's sqrt(v)
ZERO3_SUB_GROUP = 10**9  # DeepSpeed's stage3 sub_group_size default: the parameters one step call updates
# A trainer process's CUDA context, cuBLAS workspace, NCCL and DeepSpeed's own buffers, by
# ZeRO stage: the peaks measured on one H200 (PyTorch 2.11, DeepSpeed 0.19.8) with the tiny
# model, whose own states are 0.01 GiB (docs/benchmarks.md, "On a GPU"; ZeRO 1 taken as 2's).
RUNTIME_GIB = {0: 1.4, 1: 2.3, 2: 2.3, 3: 2.7}
# An inference stage's worker (plain torch, no NCCL or DeepSpeed): its CUDA context and
# cuBLAS workspace. Estimated, not measured: no such worker has run on a GPU yet.
STAGE_RUNTIME_GIB = 0.8
# Bytes a full-vocabulary logit entry costs at its peak in the trainer's forward and backward
# (``Trainer._logprobs``: the model's output, its ``.float()`` over the temperature, then
# ``token_logprobs`` with the entropy, as the training forward always asks): the log-softmax and
# the probabilities its entropy keeps (8), and in the backward the gradients of the entropy, the
# gathered log-probs, the log-softmax and the division (16). With ``rollout.top_p`` < 1 (or
# ``top_k``) ``truncated_logits`` adds its sort's values and int64 indices, its cumulative sum,
# boolean masks and the masked copy. Measured: the peak of the live vocabulary-sized tensors over
# a forward and backward on this CPU, 23.9 and 37.8 bytes an entry, the same in bf16, autocast
# and fp32 (tests/workers/cluster/test_forward_calibration.py).
LOGITS_ENTRY_BYTES = 24
TRUNCATED_LOGITS_ENTRY_BYTES = 38
# A run without rollout.max_model_len bounds its prompts by nothing the planner can read: its
# longest sequence is counted as rollout.max_tokens and this many prompt tokens.
PROMPT_TOKENS_ASSUMED = 1024


# -- the model ------------------------------------------------------------------------------

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


# -- a trainer rank -------------------------------------------------------------------------

def trainer_precision(dtype: str, zero_stage: int) -> str:
    """How the trainer holds a model of ``dtype`` (``workers.train.deepspeed_setup.deepspeed_config``;
    a test keeps the two in step): ``fp32``; ``autocast`` (bfloat16/float16 at ZeRO 0:
    fp32 parameters, gradients and AdamW, torch autocast for the matmuls); ``mixed``
    (bfloat16/float16 at ZeRO 1-3: DeepSpeed's bf16/fp16 mode, fp32 master weights,
    gradients accumulated in fp32)."""
    if dtype == "float32":
        return "fp32"
    return "autocast" if zero_stage == 0 else "mixed"


@dataclass(frozen=True)
class TrainerMemory:
    """A trainer rank's GPU memory in GiB (activations come on top). Transients, of which
    only the largest counts (they never coexist): ``step_gib``, the fp32 gradients
    flattened for the optimizer step; ``gather_gib``, ZeRO-3's largest module gathered for a
    weight sync; ``cast_gib``, autocast's low-precision weight copies kept from the
    forward for the backward."""
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float  # fp32 master weights (if any) + Adam's two moments
    step_gib: float = 0.0  # the flattened fp32 gradients (if any) + AdamW's temporaries
    gather_gib: float = 0.0
    cast_gib: float = 0.0
    master: bool = True  # an fp32 master copy is part of optimizer_gib
    reference_gib: float = 0.0  # a KL reference model, when the run has one (not in total_gib)

    @property
    def transient(self) -> tuple[str, float]:
        """(what, GiB) of the largest transient."""
        return max((("fp32 gradients and AdamW's temporaries at the optimizer step", self.step_gib),
                    ("largest module gathered for a weight sync (ZeRO-3)", self.gather_gib),
                    ("low-precision weight copies for the backward (autocast)", self.cast_gib)),
                   key=lambda t: t[1])

    @property
    def transient_gib(self) -> float:
        return self.transient[1]

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.gradients_gib + self.optimizer_gib + self.transient_gib


def trainer_memory(params: int, dtype: str, zero_stage: int, ranks: int,
                   largest_module: Optional[int] = None) -> TrainerMemory:
    """Bytes per parameter as DeepSpeed 0.19.8 holds them (``lp``: the model dtype's
    bytes, ``n``: the ranks; see :func:`trainer_precision`):

    - fp32 and autocast (fp32 parameters; torch AdamW alone at ZeRO 0, engine.py
      ``_do_optimizer_sanity_check`` returning None): weights 4, gradients 4, moments 8
      (``zeros_like`` the fp32 parameter). Stage 1/2 (stage_1_and_2.py) clone an fp32
      master partition even from fp32 (``.detach().clone().to(fp32)``): 4 / n, moments
      8 / n, stage 2 gradients 4 / n. Stage 3 (stage3.py): weights 4 / n, gradients 4 / n,
      no master (the fp32 partition is its own), moments 8 / n, gather 4. Autocast keeps
      the forward's ``lp`` copies of the weights for the backward: ``lp``.
    - mixed, stage 1: bfloat16 with fp32 accumulation is ``BF16_Optimizer``
      (``_do_optimizer_sanity_check``): weights 2, gradients 2 + 4 (the lp ``.grad`` and
      the full fp32 ``fp32_groups_gradients_flat``), master 4 / n, moments 8 / n; float16
      is ``DeepSpeedZeroOptimizer`` with an fp32 ``grad_accum`` per parameter: the same,
      plus the partition flattened at the step, 4 / n.
    - mixed, stage 2: weights lp, gradients 4 / n (the partition accumulated in fp32),
      master 4 / n, moments 8 / n, step 4 / n.
    - mixed, stage 3: weights lp / n, gradients 4 / n (``grad_partitions_flat_buffer``
      in fp32), master 4 / n, moments 8 / n, step 4 / n (per sub-group: an upper bound),
      gather lp.

    ZeRO-3's gather for a weight sync (``Trainer.state_dict``, ``_gathered_state_dict``) holds
    one module's own parameters at a time, gathered, copied to the CPU and released before the
    next: its bytes per parameter above are of ``largest_module`` parameters (the embedding or
    the LM head, as a rule), or of all ``params`` when that is unknown (an upper bound).

    At every stage the step adds AdamW's temporaries: torch's multi-tensor AdamW computes
    ``sqrt(v)`` into new tensors, 4 bytes a parameter it updates at once (4; 4 / n of a
    ZeRO-1/2 partition; at ZeRO-3 at most a sub-group of 1e9; measured on this CPU: 3.99
    bytes a parameter above the resident memory before the step).

    The KL reference: 4 (fp32, autocast) or lp (mixed) per parameter, unpartitioned.
    """
    lp = DTYPE_BYTES[dtype]
    n, stage = ranks, zero_stage
    mode = trainer_precision(dtype, stage)
    step = gather = cast = 0.0
    if mode in ("fp32", "autocast"):
        weights = 4 / n if stage >= 3 else 4
        gradients = 4 / n if stage >= 2 else 4
        master = 4 / n if stage in (1, 2) else 0
        moments = 8 / n if stage >= 1 else 8
        gather = 4 if stage >= 3 else 0
        cast = lp if mode == "autocast" else 0
        reference = 4
    else:
        weights = lp / n if stage >= 3 else lp
        gradients = lp + 4 if stage == 1 else 4 / n
        master, moments = 4 / n, 8 / n
        step = 0 if stage == 1 and dtype == "bfloat16" else 4 / n
        gather = lp if stage >= 3 else 0
        reference = lp
    # ZeRO-3 steps sub-group by sub-group (DeepSpeed's sub_group_size, 1e9 parameters)
    updated = params / n if stage >= 1 else params
    if stage >= 3:
        updated = min(updated, ZERO3_SUB_GROUP)
    step += ADAM_TEMPORARY_BYTES * updated / params if params else 0.0
    gib = params / GIB
    gathered = min(largest_module or params, params) / GIB
    return TrainerMemory(weights * gib, gradients * gib, (master + moments) * gib, step * gib, gather * gathered,
                         cast * gib, master > 0, reference * gib)


def lora_trainer_memory(params: int, adapter: int, dtype: str, zero_stage: int, ranks: int,
                        reference_adapter: int = 0) -> TrainerMemory:
    """``trainer_memory`` of a model.lora run: the frozen base model's ``params`` are weights
    alone (4 bytes under fp32 and autocast, where the trainer loads them in fp32; ``lp`` in
    DeepSpeed's bf16/fp16 modes, which cast the whole module), never partitioned (ZeRO-3 is
    refused with LoRA) and without gradients, master copy or Adam states, since the
    optimizer is built over the ``adapter``'s parameters only; those are counted as a model
    of their own. Autocast's low-precision copies are of every weight the forward reads. The
    KL reference is the same module: with the adapter disabled, nothing more; with
    model.lora.init, ``reference_adapter`` parameters more (:func:`reference_adapter_params`),
    frozen weights as the base's are (the reference forward is no-grad: no autocast copies kept)."""
    own = trainer_memory(adapter, dtype, zero_stage, ranks)
    mode = trainer_precision(dtype, zero_stage)
    base = (4 if mode in ("fp32", "autocast") else DTYPE_BYTES[dtype]) * (params + reference_adapter) / GIB
    cast = DTYPE_BYTES[dtype] * params / GIB if mode == "autocast" else 0.0
    return TrainerMemory(own.weights_gib + base, own.gradients_gib, own.optimizer_gib, own.step_gib, own.gather_gib,
                         own.cast_gib + cast, own.master, 0.0)


def run_trainer_memory(spec: "RunSpec", model: ModelSize, dtype: str, ranks: int) -> TrainerMemory:
    """The policy's ``TrainerMemory`` for ``spec``: with model.lora and a known adapter size,
    ``lora_trainer_memory``; otherwise full fine-tuning (an unknown adapter: counted as full,
    an upper bound)."""
    stage = spec.trainer.zero_stage
    if spec.model.lora is not None and model.adapter is not None:
        in_trainer = spec.algorithm.kl_reference != "stage"
        return lora_trainer_memory(model.params, model.adapter, dtype, stage, ranks,
                                   reference_adapter_params(spec, model) if in_trainer else 0)
    return trainer_memory(model.params, dtype, stage, ranks, model.largest_module)


def reference_adapter_params(spec: "RunSpec", model: ModelSize) -> int:
    """The KL reference's adapter: a run with model.lora.init and kl_coef > 0 takes its starting
    policy as the reference, the init adapter kept frozen beside the one that trains (in the
    trainer, workers/train/lora.py ``keep_reference_adapter``) or on the stage's base model
    (``kl_reference: stage``). Its parameters, the adapter's count; 0 otherwise or when unknown."""
    lora = spec.model.lora
    if lora is None or not lora.init or spec.algorithm.kl_coef <= 0 or model.adapter is None:
        return 0
    return model.adapter


def longest_sequence(spec: "RunSpec") -> int:
    """The longest sequence a trainer micro-batch can hold: rollout.max_model_len (prompt and
    completion; vLLM skips longer prompts), else rollout.max_tokens and ``PROMPT_TOKENS_ASSUMED``
    prompt tokens."""
    return spec.rollout.max_model_len or spec.rollout.max_tokens + PROMPT_TOKENS_ASSUMED


def forward_tokens(spec: "RunSpec") -> int:
    """Padded tokens of the largest trainer forward: ``trainer.micro_batch_tokens``, or the longest
    sequence where that is longer (``pack_first_fit_decreasing`` gives a sequence longer than the
    budget a micro-batch of its own)."""
    return max(spec.trainer.micro_batch_tokens, longest_sequence(spec))


def layer_activation_bytes(model: ModelSize, precision: str) -> tuple[float, float]:
    """(bytes per token and layer, bytes per token and row length) that autograd keeps of one
    decoder layer for the backward: the tensors its saved-tensor hooks see in HF's forward,
    each storage once (``tests/workers/cluster/test_forward_calibration.py`` measures them).
    ``precision``: :func:`trainer_precision`'s. ``a`` is the forward's element size (the model
    dtype's in DeepSpeed's bf16/fp16 mode and under autocast, 4 in fp32); h hidden, kv the K/V
    heads' width, i the MLP's, n the heads.

    - "gated" (RMSNorm, RoPE, SDPA, SwiGLU: Llama, Qwen2). Each RMSNorm keeps its input upcast
      to fp32 (4h), its 1/rms (4), the normalised values and its output (2 a h); attention keeps
      q after RoPE and the output (2 a h), K and V (2 a kv) and SDPA's fp32 log-sum-exp (4 n);
      the MLP keeps gate, up, SiLU(gate) and their product (4 a i). Under autocast the residual
      stream is fp32: each norm keeps 4h + 4 + 4h, every projection its own low-precision cast
      of its input (5 a h: q, k, v, gate, up), and SDPA q, K and V cast after K/V are repeated
      to every head (3 a h) and its output (a h). SDPA keeps each layer's own copy of the padding
      mask (a per token and row position).
    - "gpt2" (LayerNorm, fused QKV, GELU MLP): each LayerNorm keeps its input, mean, 1/std and
      output (2 a h + 4 a), attention the fused QKV output (3 a h), q, k and the output (3 a h)
      and the log-sum-exp (4 n); the MLP, with GELU's tanh form written out (``gelu_new``), five
      i-wide tensors (5 a i; two with a fused GELU); each layer copies the padding mask (a per
      token and row position; 2 under autocast). Under autocast: 24 h + 10 i + 4 n + 16.

    The first element per layer, the second x the micro-batch's row length (the padding mask;
    without padding HF passes none, so this is an upper bound)."""
    h, i = model.hidden, model.intermediate or 4 * model.hidden
    n = model.heads or 1
    kv = model.kv_hidden or h
    a = 4 if precision == "fp32" else 2
    if model.family == "gpt2":
        mlp = (5 if model.activation in (None, "gelu_new", "gelu_fast") else 2) * i
        if precision == "autocast":
            return 24 * h + 2 * mlp + 4 * n + 16, 2
        return a * (10 * h + mlp) + 4 * n + 4 * a, a
    if precision == "autocast":
        return 2 * (8 * h + 4) + a * (5 * h + 4 * h + 4 * i) + 4 * n, a
    return 2 * (4 * h + 4 + 2 * a * h) + a * (2 * h + 2 * kv + 4 * i) + 4 * n, a


def forward_memory(model: ModelSize, tokens: int, dtype: str, zero_stage: int,
                   checkpointing: bool = False, row: Optional[int] = None,
                   truncated: bool = False) -> tuple[float, float]:
    """(activations, logits) in GiB of one micro-batch of ``tokens`` (padded) tokens, rows of
    at most ``row`` tokens (default ``tokens``), in the trainer's forward and backward; (0, 0)
    when the model's shape is unknown.

    - Activations: :func:`layer_activation_bytes` per token and layer, and once per forward the
      token ids (8) and the final norm; with ``trainer.gradient_checkpointing`` each layer keeps
      only its input (the residual stream: 4 h under autocast, a h otherwise) and one layer's
      full set is rebuilt at a time.
    - Logits at the full vocabulary: ``LOGITS_ENTRY_BYTES`` per ``tokens x vocab`` entry,
      ``TRUNCATED_LOGITS_ENTRY_BYTES`` with ``truncated`` (rollout.top_p < 1 or top_k). For
      Qwen2.5's 151,936-token vocabulary and 4,096 tokens that is 13.9 GiB, more than the 0.5 B
      model's weights and Adam states together.
    """
    if not (model.hidden and model.layers and model.vocab):
        return 0.0, 0.0
    precision = trainer_precision(dtype, zero_stage)
    a = 4 if precision == "fp32" else DTYPE_BYTES[dtype]
    row = min(row or tokens, tokens)
    per_layer, per_row = layer_activation_bytes(model, precision)
    per_layer += per_row * row
    final_norm = (8 if precision == "autocast" else 4 + 2 * a) * model.hidden + 4
    once = 8 + final_norm
    if checkpointing:
        residual = 4 if precision == "autocast" else a
        values = model.layers * residual * model.hidden + per_layer
    else:
        values = model.layers * per_layer
    activations = tokens * (values + once) / GIB
    entry = TRUNCATED_LOGITS_ENTRY_BYTES if truncated else LOGITS_ENTRY_BYTES
    logits = tokens * model.vocab * entry / GIB
    return activations, logits


def inference_forward_gib(model: ModelSize, tokens: int, act_bytes: int, logits: bool, sort: bool) -> float:
    """GiB of one no-grad forward of ``tokens`` padded tokens in an inference stage's worker
    (nothing is kept for a backward): about one layer's live values (its input, q, k, v and
    output, the MLP's three i-wide tensors) and the residual stream, 10 h + 3 i per token in
    ``act_bytes``, and, for the KL reference
    (``logits``), the full-vocabulary logits: the model's output, its fp32 ``.float()`` and
    temperature-scaled copies and the log-softmax (``act_bytes`` + 12 per entry), plus a
    sort's values and int64 indices (12) when top-k/top-p truncate. 0 when the shape is unknown."""
    if not (model.hidden and model.vocab):
        return 0.0
    total = tokens * (10 * model.hidden + 3 * (model.intermediate or 4 * model.hidden)) * act_bytes
    if logits:
        total += tokens * model.vocab * (act_bytes + 12 + (12 if sort else 0))
    return total / GIB


def trainer_forward_gib(spec: "RunSpec", model: ModelSize, dtype: str) -> tuple[int, float, float]:
    """(tokens, activations GiB, logits GiB) of the trainer's largest forward for ``spec``
    (:func:`forward_tokens`, :func:`forward_memory`)."""
    tokens = forward_tokens(spec)
    truncated = spec.rollout.top_p < 1 or spec.rollout.top_k > 0
    activations, logits = forward_memory(model, tokens, dtype, spec.trainer.zero_stage,
                                         spec.trainer.gradient_checkpointing, row=longest_sequence(spec),
                                         truncated=truncated)
    return tokens, activations, logits


def trainer_rank_peak_gib(spec: "RunSpec", model: ModelSize, ranks: int, dtype: Optional[str] = None) -> float:
    """A trainer rank's planned peak, GiB: its runtime buffers, states, the critic's, the KL
    reference and the largest transient (the step's, ZeRO-3's gather, or a micro-batch's
    forward), as :func:`plan_memory` lays them on its GPU while it trains."""
    dtype = dtype or model_dtype(spec, on_gpu=True)
    stage = spec.trainer.zero_stage
    mem = run_trainer_memory(spec, model, dtype, ranks)
    _, activations, logits = trainer_forward_gib(spec, model, dtype)
    critic = (trainer_memory(model.params, dtype, spec.critic.zero_stage, ranks)
              if spec.algorithm.advantage == "gae" else None)
    return (RUNTIME_GIB[stage] + mem.weights_gib + mem.gradients_gib + mem.optimizer_gib
            + (critic.weights_gib + critic.gradients_gib + critic.optimizer_gib if critic else 0.0)
            + (mem.reference_gib if trainer_holds_reference(spec) else 0.0)
            + max(mem.transient_gib, mem.cast_gib + activations + logits))


# -- a whole plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One thing on a GPU: ``owner`` (``trainer rank 0``, ``engine 1``), ``what``, GiB,
    and ``kind`` (what would lower it: trainer, reference, engine, receive)."""
    owner: str
    what: str
    gib: float
    kind: str


@dataclass(frozen=True)
class GpuLoad:
    node: int
    gpu: int  # the plan's node-local id
    items: tuple[Item, ...]
    phase: str = ""  # colocated plans: "generating", "updating" or "training" (engines asleep through the step)

    @property
    def total_gib(self) -> float:
        return sum(i.gib for i in self.items)

    def listing(self) -> str:
        """"trainer rank 0 weights 13.0, gradients 13.0; engine 0 ..." (GiB)."""
        owners = dict.fromkeys(i.owner for i in self.items)
        return "; ".join(owner + " " + ", ".join(f"{i.what} {i.gib:.1f}" for i in self.items if i.owner == owner)
                         for owner in owners)


@dataclass(frozen=True)
class MemoryPlan:
    """Per GPU of a GPU plan, what it holds (:class:`Item`), and the engines' own check
    (their weights within their share); :meth:`problem` says what does not fit."""
    gpu_memory_gib: float
    gpus: tuple[GpuLoad, ...]
    trainer: TrainerMemory
    engine_weights_gib: float  # per engine GPU (weights / tensor_parallel)
    engine_share_gib: float  # gpu_memory_utilization x a GPU's memory
    kv_cache_gib: float  # what an engine's share leaves for the KV cache and activations, per GPU
    kv_needed_gib: Optional[float]  # one rollout.max_model_len sequence's KV cache per GPU, when known
    hints: tuple[tuple[str, str], ...] = ()  # (item kind, the spec fields that lower it)
    colocate: bool = False

    def problem(self) -> Optional[str]:
        if self.engine_share_gib and self.kv_cache_gib <= 0:
            return (f"resources.gpu_memory_utilization: an engine's weights take {self.engine_weights_gib:.1f} GiB "
                    f"per GPU, its share of a GPU is {self.engine_share_gib:.1f} GiB: nothing is left for the KV "
                    "cache; raise resources.gpu_memory_utilization or resources.tensor_parallel")
        if self.kv_needed_gib is not None and self.kv_cache_gib < self.kv_needed_gib:
            return (f"rollout.max_model_len: one sequence's KV cache takes {self.kv_needed_gib:.1f} GiB per GPU, an "
                    f"engine's share leaves {self.kv_cache_gib:.1f} GiB after its weights (activations come on "
                    "top); lower rollout.max_model_len, or raise resources.gpu_memory_utilization or "
                    "resources.tensor_parallel")
        for load in self.gpus:
            total = load.total_gib
            if total <= self.gpu_memory_gib:
                continue
            top = max(load.items, key=lambda i: i.gib)
            kinds = {i.kind for i in load.items}
            hints = [hint for kind, hint in self.hints if kind in kinds]
            return (f"resources: GPU {load.gpu} of node {load.node} needs {total:.1f} GiB"
                    + {"generating": " while the engines generate",
                       "updating": " while the engines take the weight update (their KV cache asleep)",
                       "training": " while the trainer steps (the engines asleep)", "": ""}[load.phase]
                    + f", it has {self.gpu_memory_gib:.1f}: {load.listing()}. The largest is {top.owner}'s "
                    f"{top.what}." + (" To fit: " + "; ".join(hints) if hints else ""))
        return None

    def describe(self) -> list[str]:
        lines = [f"  GPU {load.gpu} of node {load.node}" + (f", {load.phase}" if load.phase else "")
                 + f": {load.total_gib:.1f} of {self.gpu_memory_gib:.1f} GiB ({load.listing()})" for load in self.gpus]
        if self.engine_share_gib:
            lines.append(f"  an engine's share per GPU: {self.engine_share_gib:.1f} GiB, its weights "
                         f"{self.engine_weights_gib:.1f}, left for the KV cache and activations "
                         f"{self.kv_cache_gib:.1f}")
        return lines


def trainer_holds_reference(spec: "RunSpec") -> bool:
    """The trainer loads a KL reference model of its own: kl_coef > 0, in the trainer (not the
    inference stage), without model.lora (whose reference is the policy's own module: the base
    model, adapter off, or with the frozen init adapter, counted in its weights)."""
    return spec.algorithm.kl_coef > 0 and spec.algorithm.kl_reference != "stage" and spec.model.lora is None


def inference_items(spec: "RunSpec", p, model: ModelSize, reward_model: Optional[ModelSize], dtype: str,
                    forwarding: bool) -> list[Item]:
    """What an inference stage's worker (``p``, role "inference") holds on its GPU: a CUDA
    context, its model (the KL reference and the critic's copy in the trainer's load dtype,
    the reward model in its folder's), and while the rollout generates (``forwarding``) a
    forward of ``inference.micro_batch_tokens`` tokens (the workers split micro-batches to that)."""
    stage = spec.trainer.zero_stage
    tokens = spec.inference.micro_batch_tokens
    items = [Item(p.name, "CUDA context (estimated)", STAGE_RUNTIME_GIB, "inference")]
    if p.label == REWARD_MODEL:
        if reward_model is None:
            return items + [Item(p.name, "model (size unknown: not counted)", 0.0, "inference")]
        rm_bytes = DTYPE_BYTES[reward_model.saved_dtype or "float32"]
        items.append(Item(p.name, "reward model", reward_model.params * rm_bytes / GIB, "inference"))
        forward = inference_forward_gib(reward_model, tokens, rm_bytes, logits=False, sort=False)
    else:
        reference = p.label == REFERENCE_STAGE
        held = model.params + (reference_adapter_params(spec, model) if reference else 0)
        weights = trainer_memory(held, dtype, stage, 1).reference_gib  # fp32 under autocast, else lp
        act = 4 if trainer_precision(dtype, stage) == "fp32" else DTYPE_BYTES[dtype]
        items.append(Item(p.name, "reference model" if reference else "critic's copy", weights, "inference"))
        truncated = spec.rollout.top_p < 1 or spec.rollout.top_k > 0
        forward = inference_forward_gib(model, tokens, act, logits=reference, sort=truncated)
    if forwarding and forward:
        items.append(Item(p.name, f"a forward of {tokens} tokens", forward, "inference"))
    return items


def plan_memory(spec: "RunSpec", plan, gpu_memory_gib: float, model: ModelSize,
                reward_model: Optional[ModelSize] = None) -> MemoryPlan:
    """What each GPU of ``plan`` (a GPU ``workers.cluster.placement.Plan``, not imported: the
    planner imports this module) holds on GPUs of ``gpu_memory_gib``; see the module's
    docstring for each item. ``reward_model``: the size of reward.model's folder, if known."""
    dtype, stage, ranks = model_dtype(spec, on_gpu=True), spec.trainer.zero_stage, len(plan.trainers)
    lp = DTYPE_BYTES[dtype]
    model_gib = model.params * lp / GIB  # what the engines hold and receive: the weights in the model's dtype
    trainer = run_trainer_memory(spec, model, dtype, ranks)
    critic = (trainer_memory(model.params, dtype, spec.critic.zero_stage, ranks)
              if spec.algorithm.advantage == "gae" else None)  # the trainer trains it, wherever it values
    tokens, activations, logits = trainer_forward_gib(spec, model, dtype)
    forward_gib = trainer.cast_gib + activations + logits
    forward_what = (f"a micro-batch's forward of {tokens} tokens (activations {activations:.1f}, full-vocabulary "
                    f"logits {logits:.1f}"
                    + (f", autocast's weight copies {trainer.cast_gib:.1f}" if trainer.cast_gib else "") + ")")
    reference = trainer_holds_reference(spec)
    collective = spec.rollout.weight_transport == "collective"
    receive_gib = 2 * max(BUCKET_BYTES, (model.largest or 0) * lp) / GIB
    capacity = gpu_memory_gib
    # phase -> (node, gpu) -> items; colocated engines sleep through the trainer's step; colocated
    # engines of an overlapped schedule never sleep: their share and the trainer's step add up
    phases = ("generating", "updating", "training") if plan.sleeps else ("",)
    loads: dict[str, dict[tuple[int, int], list[Item]]] = {phase: {} for phase in phases}
    share = 0.0
    for phase in phases:
        for p in plan.processes:
            owner = f"trainer rank {p.index}" if p.role == "trainer" else p.name
            for gpu in p.gpus:
                items = loads[phase].setdefault((p.node, gpu), [])
                if p.role == "inference":  # forwards while the rollout generates, weights always
                    items += inference_items(spec, p, model, reward_model, dtype, phase in ("", "generating"))
                elif p.role == "trainer":
                    items += [Item(owner, "CUDA context and runtime buffers (measured)", RUNTIME_GIB[stage], "runtime"),
                              Item(owner, "weights", trainer.weights_gib, "trainer"),
                              Item(owner, "gradients", trainer.gradients_gib, "trainer"),
                              Item(owner, "fp32 master weights and Adam states" if trainer.master else "Adam states",
                                   trainer.optimizer_gib, "trainer")]
                    if critic is not None:
                        items.append(Item(owner, "critic's weights, gradients and optimizer states",
                                          critic.weights_gib + critic.gradients_gib + critic.optimizer_gib, "critic"))
                    what, gib = trainer.transient
                    if forward_gib > gib:
                        what, gib = forward_what, forward_gib
                    if phase == "updating":  # ZeRO-3 gathers each module in turn to send them
                        what, gib = "largest module gathered for a weight sync (ZeRO-3)", trainer.gather_gib
                    if gib and phase != "generating":
                        items.append(Item(owner, what, gib, "forward" if what == forward_what else "trainer"))
                    if reference:
                        items.append(Item(owner, "KL reference model", trainer.reference_gib, "reference"))
                elif phase == "updating":  # the weights awake, the KV cache still asleep
                    items.append(Item(owner, "weights (awake for the update)", model_gib / plan.tensor_parallel,
                                      "engine"))
                    if collective:
                        items.append(Item(owner, "weight-receive buffers (collective transport, 2 buckets)",
                                          receive_gib, "receive"))
                elif phase != "training":
                    share = p.gpu_memory_utilization * capacity
                    items.append(Item(owner, f"vLLM share (gpu_memory_utilization {p.gpu_memory_utilization:g})",
                                      share, "engine"))
                    if collective:
                        items.append(Item(owner, "weight-receive buffers (collective transport, 2 buckets)",
                                          receive_gib, "receive"))
    tp = plan.tensor_parallel
    engine_weights = model_gib / tp if plan.engines else 0.0
    kv_needed = None
    if plan.engines and model.kv_values_per_token and spec.rollout.max_model_len:
        kv_needed = model.kv_values_per_token * lp * spec.rollout.max_model_len / tp / GIB
    zero_hint = (f"raise trainer.zero_stage (now {stage}) or resources.trainer_ranks (now {ranks})" if stage < 3
                 else f"raise resources.trainer_ranks (now {ranks}, ZeRO-3)")
    hints = (("trainer", zero_hint),
             ("forward", f"lower trainer.micro_batch_tokens (now {spec.trainer.micro_batch_tokens})"
                         + ("" if spec.trainer.gradient_checkpointing else " or set trainer.gradient_checkpointing")),
             ("critic", f"raise critic.zero_stage (now {spec.critic.zero_stage})"),
             ("reference", "set algorithm.kl_coef 0 (its reference model is a full copy on every trainer GPU)"),
             ("engine", "lower resources.gpu_memory_utilization" + (", or set resources.colocate false"
                                                                      if plan.colocate else "")),
             ("receive", "set rollout.weight_transport rpc (it receives the weights in host memory)"),
             ("inference", f"lower inference.micro_batch_tokens (now {spec.inference.micro_batch_tokens}) or move "
                           f"the inference stage (resources.inference_gpu, now '{spec.resources.inference_gpu}')"))
    gpus = tuple(GpuLoad(node, gpu, tuple(items), phase) for phase in phases
                 for (node, gpu), items in sorted(loads[phase].items()))
    return MemoryPlan(capacity, gpus, trainer, engine_weights, share, share - engine_weights if plan.engines else 0.0,
                      kv_needed, hints, plan.sleeps)
