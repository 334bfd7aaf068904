"""GPU memory of one trainer rank (workers/cluster/memory.py): the persistent states DeepSpeed
and AdamW keep at each ZeRO stage and precision, the transients of an optimizer step and of
ZeRO-3's gather, and the largest micro-batch's activations and full-vocabulary logits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from workers.cluster.model_size import DTYPE_BYTES, GIB, ModelSize
from workers.spec import model_dtype

if TYPE_CHECKING:
    from workers.spec import RunSpec

ADAM_TEMPORARY_BYTES = 4  # per parameter updated: torch's multi-tensor AdamW's sqrt(v)
ZERO3_SUB_GROUP = 10**9  # DeepSpeed's stage3 sub_group_size default: the parameters one step call updates
# A trainer process's CUDA context, cuBLAS workspace, NCCL and DeepSpeed's own buffers, by
# ZeRO stage: the peaks measured on one H200 (PyTorch 2.11, DeepSpeed 0.19.8) with the tiny
# model, whose own states are 0.01 GiB (docs/benchmarks.md, "On a GPU"; ZeRO 1 taken as 2's).
RUNTIME_GIB = {0: 1.4, 1: 2.3, 2: 2.3, 3: 2.7}
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

    ZeRO-3's gather for a weight sync (``Trainer.state_dict``, ``gathered_state_dict``) holds
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


def trainer_holds_reference(spec: "RunSpec") -> bool:
    """The trainer loads a KL reference model of its own: kl_coef > 0, in the trainer (not the
    inference stage), without model.lora (whose reference is the policy's own module: the base
    model, adapter off, or with the frozen init adapter, counted in its weights)."""
    return spec.algorithm.kl_coef > 0 and spec.algorithm.kl_reference != "stage" and spec.model.lora is None
