"""The run spec: the one document shared by the CLI, the REST API, the dashboard form
and the worker processes. Validated here and nowhere else; unknown fields are rejected
by name (pydantic ``extra="forbid"``)."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SpecError(ValueError):
    """A run spec that cannot run. ``errors`` is a list of {"field": "a.b", "message": ...}."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


# algorithm.minibatches for loss ppo when the spec leaves it out: measured on the demo by
# bench/minibatches.py (docs/engine.md, "Trainer": why 2).
DEFAULT_PPO_MINIBATCHES = 2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# vLLM's accepted max_lora_rank values (vllm/config/lora.py MaxLoRARanks): an engine serves
# adapters up to the smallest of these at or above model.lora.rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSpec(_Strict):
    """LoRA RL (docs/guides/lora.md): PEFT's low-rank adapter on the policy; only the adapter
    trains, and each weight update sends only the adapter, which vLLM serves as a LoRA."""
    rank: int = Field(8, ge=1, le=512, description="the adapter's rank r")
    alpha: float = Field(16.0, gt=0, description="scaling: the update is (alpha / rank) x B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (off in every RL "
                           "forward: the trainer runs the policy in eval mode so its ratios carry no noise)")
    target_modules: Optional[list[Annotated[str, Field(min_length=1, max_length=100)]]] = Field(
        None, min_length=1, max_length=64, description="the linear layers that get an adapter, by name (e.g. "
        "[q_proj, k_proj, v_proj, o_proj]); default: PEFT's choice for the architecture")
    init: Optional[str] = Field(None, max_length=4096, description="start from this adapter instead of B = 0: a "
                                "PEFT folder (adapter_config.json, adapter_model.safetensors), e.g. a finished "
                                "run's final_model/adapter; its rank, alpha and target_modules must be these")


class ModelSpec(_Strict):
    path: str = Field(description="local HF model folder (or hub id on a cluster)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the precision it trains and generates in; auto: bfloat16 where the run's GPUs have "
        "it, float32 on the CPU (decided on the machine that runs it: model_dtype)")
    lora: Optional[LoraSpec] = Field(None, description="train a LoRA adapter instead of the full model "
                                     "(absent: full fine-tuning)")


def model_dtype(spec: "RunSpec", on_gpu: Optional[bool] = None) -> str:
    """``model.dtype`` with ``auto`` decided: bfloat16 on a GPU that has it, float32 on the
    CPU. ``on_gpu``: for a plan made for GPUs (the planner), else this machine's devices."""
    if spec.model.dtype != "auto":
        return spec.model.dtype
    if on_gpu is None:
        return _auto_dtype()
    return "bfloat16" if on_gpu else "float32"


@functools.cache
def _auto_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


# Absolute caps on what one spec may ask, whatever the deployment: a completion longer than
# any model's context an RL run generates, and a run (or one evaluation) longer than a month,
# are mistakes, and each multiplies a run's total work (run_work; the platform bounds that).
MAX_TOKENS = 262_144
MAX_RUN_MINUTES = 30 * 24 * 60


class EnvironmentSpec(_Strict):
    """task.environment: each sample is an episode of several turns (docs/guides/agentic.md).
    The policy generates a turn, the environment answers with an observation (a tool's
    output, feedback, a new message), until the environment ends the episode or a budget
    runs out. Observation tokens are masked out of the loss."""
    name: str = Field(min_length=1, max_length=200, description="a built-in environment "
                      "(workers.agents.builtin.BUILTIN_ENVIRONMENTS: tools, guess_number), 'user' with code, or "
                      "(on the platform) a team environment name@version")
    code: Optional[str] = Field(None, max_length=200_000, description="user Python defining a class Environment "
                                "with reset(self, row) and step(self, text, token_ids) returning (observation, "
                                "reward, done); run only in the OS sandbox")
    tools: list[Literal["calculator", "python"]] = Field(
        default_factory=lambda: ["calculator"], max_length=8, description="tools the 'tools' environment offers "
        "(parsed from the model's tool-call format, e.g. Qwen2's <tool_call> JSON)")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the environment")
    max_turns: int = Field(4, ge=1, le=64, description="generated turns per episode at most")
    max_turn_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS, description="tokens one turn generates "
                                           "at most; default: rollout.max_tokens")
    max_episode_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="generated and observation tokens "
                                    "of an episode at most (after the prompt)")
    max_observation_tokens: int = Field(256, ge=1, le=MAX_TOKENS, description="an observation longer than this "
                                        "is cut to it (and says so)")
    rewards: Literal["final", "turns", "both"] = Field(
        "final", description="final: the reward section scores the episode's last generated turn; turns: the "
        "environment's per-turn rewards alone; both: their sum")
    timeout_s: float = Field(5.0, gt=0, le=600, description="each environment call (reset, step) and each tool "
                             "call at most, wall clock: a call past it is killed and named in the sample")
    memory_mb: int = Field(512, ge=64, le=8192, description="a sandboxed environment's or tool's memory at most")
    output_chars: int = Field(4000, ge=1, le=1_000_000, description="a tool's output beyond this many "
                              "characters is cut off (output_limit)")

    @model_validator(mode="after")
    def _code_for_user(self):
        if self.name == "user" and not self.code:
            raise ValueError("task.environment.name 'user' needs task.environment.code")
        if self.code and self.name != "user" and "@" not in self.name:
            raise ValueError(f"task.environment.code is given but name is {self.name!r}: use name 'user'")
        return self


class TaskSpec(_Strict):
    # A JSONL file path, or a built-in generator "gen:<name>" (see workers.tasks.datasets.GENERATORS).
    dataset: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    size: int = Field(4000, ge=1, description="rows to generate for gen: datasets")
    eval_size: int = Field(200, ge=0, description="held-out rows (taken out of training)")
    seed: int = 0
    # How a row becomes the model's input (workers/tasks/prompts.py). auto: chat when the row has
    # a ``messages`` list or a ``system`` field (or system_prompt is set), raw text otherwise.
    prompt_format: Literal["auto", "raw", "chat"] = "auto"
    prompt_template: Optional[str] = Field(None, max_length=20000, description=(
        "Jinja template over the row's fields (e.g. 'Q: {{ prompt }}\\nA:'): the text (raw) or the user "
        "message (chat)"))
    system_prompt: Optional[str] = Field(None, max_length=20000, description="chat: a system message for rows "
                                         "without their own")
    environment: Optional[EnvironmentSpec] = Field(None, description="multi-turn episodes with tools or an "
                                                   "environment (docs/guides/agentic.md)")

    @field_validator("dataset")
    @classmethod
    def _generator_bounded(cls, value):
        if value.startswith("gen:"):  # its parameters within their bounds, named in the error
            from workers.tasks.datasets import parse_generator

            parse_generator(value)
        return value

    @model_validator(mode="after")
    def _generated_rows_bounded(self):
        if self.dataset.startswith("gen:"):  # task.size + task.eval_size rows, bounded (error on "task")
            from workers.tasks.datasets import parse_generator

            parse_generator(self.dataset, self.size + self.eval_size)
        return self

    @field_validator("prompt_template")
    @classmethod
    def _template_compiles(cls, value):
        if value is not None:
            from workers.tasks.prompts import compile_template

            compile_template(value)  # ValueError naming the line
        return value


class RewardComponent(_Strict):
    """One term of a weighted-sum reward (``reward.components``): weight x
    function(prompt, completion, **row fields, **params)."""
    function: str = Field(description="a built-in reward (workers.tasks.builtin_rewards.BUILTIN_REWARDS), 'user': the "
                          "run's reward.code, or 'model': the run's reward.model")
    weight: float = Field(1.0, allow_inf_nan=False, description="multiplies the component's reward; negative: a "
                          "penalty; 0: scored and reported, not trained on")
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the function, e.g. "
                                   "{pattern: ...} for format_check; they win over dataset-row fields of the same name")
    name: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description=(
        "the component's label (Score.parts, metrics reward/<name>); default: its function"))

    @field_validator("function")
    @classmethod
    def _known_function(cls, function: str) -> str:
        from pydantic_core import PydanticCustomError

        from workers.tasks.builtin_rewards import BUILTIN_REWARDS

        if function not in ("user", "model") and function not in BUILTIN_REWARDS:
            raise PydanticCustomError("reward_function", "unknown built-in {function}; choose one of {builtins}, "
                                      "'user' for the run's reward.code or 'model' for its reward.model (team "
                                      "functions cannot be components)",
                                      {"function": repr(function), "builtins": ", ".join(BUILTIN_REWARDS)})
        return function

    @field_validator("params")
    @classmethod
    def _params_fit(cls, params: dict, info) -> dict:
        import inspect
        import re

        from pydantic_core import PydanticCustomError

        from workers.tasks.builtin_rewards import BUILTIN_REWARDS

        clash = sorted({"prompt", "completion"} & set(params))
        if clash:
            raise PydanticCustomError("reward_params", "{names}: supplied by the sample, not a parameter",
                                      {"names": ", ".join(clash)})
        if info.data.get("function") == "model" and params:
            raise PydanticCustomError("reward_params", "the 'model' component takes no params (the reward model reads "
                                      "the prompt and the completion; configure it under reward.model)", {})
        function = BUILTIN_REWARDS.get(info.data.get("function"))
        if function is None:  # 'user' (its parameters are its own) or an unknown name (reported already)
            return params
        accepted = [p.name for p in inspect.signature(function).parameters.values()
                    if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in ("prompt", "completion")]
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise PydanticCustomError("reward_params", "{function} takes no parameter {unknown} (it takes: {accepted})",
                                      {"function": info.data["function"], "unknown": ", ".join(map(repr, unknown)),
                                       "accepted": ", ".join(accepted) or "none"})
        if "pattern" in params:
            try:
                re.compile(params["pattern"])
            except (re.error, TypeError) as exc:
                raise PydanticCustomError("reward_params", "pattern is not a regular expression: {error}",
                                          {"error": str(exc)}) from None
        return params


class RewardModelSpec(_Strict):
    """A neural reward model (``reward.model``), used by ``function: model`` or a component
    ``{function: model, weight}``: a Hugging Face sequence-classification folder with one
    label, run in a worker process of its own and fed in micro-batches
    (workers/rewards/model.py). It reads the prompt and the completion as one text."""
    path: str = Field(description="'builtin:tiny-rm' (built from the tiny model, python -m workers build-reward-model) "
                      "or a local HF folder of an *ForSequenceClassification model with num_labels 1")
    output: Literal["probability", "logit"] = Field(
        "probability", description="the reward: sigmoid(logit), in [0, 1] like the rule rewards, or the raw logit")
    micro_batch: int = Field(16, ge=1, le=512, description="texts per forward at most")
    max_wait_ms: float = Field(20.0, ge=0, le=10_000, description="how long a partial micro-batch waits for more")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="a micro-batch slower than this fails the run")
    threads: int = Field(1, ge=1, le=256, description="CPU threads of the reward model's process")


class RewardSpec(_Strict):
    """How each sample is scored: one ``function``, or a weighted sum of ``components``.

    - ``function``: a built-in name (workers.tasks.builtin_rewards.BUILTIN_REWARDS), "user" with
      ``code``, or (on the platform) a team function "name@version".
    - ``components``: reward = sum of weight x component; ``function`` is then "sum" (or
      omitted). Each component is a built-in, or "user": the run's ``code`` (at most one
      such component). A component's ``params`` are keyword arguments for its function and
      win over dataset-row fields of the same name (a row may not override the spec).
      Example::

          reward:
            components:
              - {function: math_answer, weight: 0.9}
              - {function: format_boxed, weight: 0.1}
              - {function: format_regex, weight: 0.05, params: {pattern: "</think>"}, name: think}
    """
    function: str = Field("numeric_match", description="a built-in, a team function name@version, 'model' with "
                          "model, 'user' with code, or 'sum' with components")
    code: Optional[str] = Field(None, description="user Python defining reward(prompt, completion, **fields)")
    timeout_s: float = Field(2.0, gt=0, le=60)
    memory_mb: int = Field(512, ge=64, le=8192)
    components: Optional[list[RewardComponent]] = Field(None, min_length=1, max_length=16, description=(
        "weighted sum: [{function, weight, params?, name?}, ...] with function 'sum' (or omitted)"))
    model: Optional[RewardModelSpec] = Field(None, description="a neural reward model, for function 'model' or a "
                                             "component {function: model}")

    @model_validator(mode="before")
    @classmethod
    def _sum_by_default(cls, data):
        if isinstance(data, dict) and data.get("components") is not None and "function" not in data:
            data = {**data, "function": "sum"}
        return data

    @model_validator(mode="after")
    def _code_for_user(self):
        if self.function == "user" and not self.code:
            raise ValueError("reward.function 'user' needs reward.code")
        if self.function == "sum" and self.components is None:
            raise ValueError("reward.function 'sum' needs reward.components")
        uses_model = self.function == "model" or any(c.function == "model" for c in self.components or [])
        if uses_model and self.model is None:
            raise ValueError("reward.function 'model' (or a component {function: model}) needs reward.model: "
                             "{path: ...}")
        if self.model is not None and not uses_model:
            raise ValueError("reward.model is set but nothing scores with it: use function 'model', or a component "
                             "{function: model, weight: ...} to mix it with other rewards")
        return self

    @field_validator("components")
    @classmethod
    def _components_fit(cls, components, info):
        from pydantic_core import PydanticCustomError

        if components is None:
            return components
        if "function" in info.data and info.data["function"] != "sum":
            raise PydanticCustomError("reward_components", "reward.function must be 'sum' or omitted with "
                                      "components, not {function} (user code can be a component with function 'user')",
                                      {"function": repr(info.data["function"])})
        models = [i for i, c in enumerate(components) if c.function == "model"]
        if len(models) > 1:
            raise PydanticCustomError("reward_components", "components {models} are all 'model': at most one component "
                                      "runs reward.model", {"models": ", ".join(map(str, models))})
        users = [i for i, c in enumerate(components) if c.function == "user"]
        if len(users) > 1:
            raise PydanticCustomError("reward_components", "components {users} are all 'user': at most one component "
                                      "runs reward.code", {"users": ", ".join(map(str, users))})
        if users and not info.data.get("code"):
            raise PydanticCustomError("reward_components", "component {i} is 'user' and needs reward.code",
                                      {"i": users[0]})
        if not users and info.data.get("code"):
            raise PydanticCustomError("reward_components", "reward.code is given but no component is 'user'", {})
        seen: dict[str, int] = {}
        for i, component in enumerate(components):
            label = component.name or component.function
            if label in seen:
                raise PydanticCustomError("reward_components", "components {a} and {b} are both named {label}: give "
                                          "one a distinct name", {"a": seen[label], "b": i, "label": repr(label)})
            seen[label] = i
        return components


# A prompt group's samples run side by side on one engine; past this a "group" is a batch
# of its own (GRPO-style runs use 4 to 64).
MAX_GROUP_SIZE = 1024


class AlgorithmSpec(_Strict):
    loss: Literal["ppo", "reinforce"] = "ppo"
    group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="samples per prompt, generated side by side: "
                            "at most 1024, and with rollout.share_engines at most rollout.max_num_seqs (the pool's "
                            "seats)")
    lr: float = Field(5e-5, gt=0)
    warmup_steps: int = Field(10, ge=0, description="linear learning-rate warm-up: Adam's first steps "
                              "are sign-like and move every weight by the full lr, a jolt that costs reward")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: keep the lr, or decay it to lr_floor x lr at stop.max_steps")
    lr_floor: float = Field(0.0, ge=0, le=1, description="the decayed lr's last value, as a share of lr")
    clip: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_penalty: Literal["loss", "reward"] = Field(
        "loss", description="where the KL to the reference goes (kl_coef > 0): loss = a penalty term added to the "
        "policy loss (kl_estimator); reward = InstructGPT's per-token reward −kl_coef·(log π_old − log π_ref), "
        "π_old the behaviour policy that sampled the token, added to the sequence's reward (on its last token) "
        "before GAE, so the critic learns it and the loss has no KL term. reward needs advantage gae")
    kl_estimator: Literal["k2", "k3"] = Field("k2", description="the KL(π‖π_ref) penalty's per-token form "
                                              "(kl_coef > 0): k2 = ½(log π − log π_ref)², whose gradient is "
                                              "that of KL(π‖π_ref); k3 = GRPO's estimator, whose gradient as a "
                                              "loss is that of the reverse KL(π_ref‖π). Stale tokens are "
                                              "importance-weighted as in the policy loss")
    kl_reference: Literal["trainer", "stage"] = Field(
        "trainer", description="where the KL reference's forward runs (kl_coef > 0): inside the trainer's step, or "
        "in the inference stage, a worker process of its own that takes each sample as it finishes generating, in "
        "micro-batches (inference.*), so the trainer holds one model less and its step one forward less")
    behav_weight_cap: float = Field(5.0, gt=0, description="correction none: ppo drops (weight 0) the tokens "
                                    "whose π_prox/π_behav passes it (AReaL); reinforce truncates π/π_behav at it")
    correction: Literal["none", "tis", "mis"] = Field(
        "none", description="how the importance ratio ρ = π_prox/π_behav between the trainer and the engine "
        "(reinforce: π_θ/π_behav) is bounded before it weights each token's loss: none = the loss's own rule "
        "(behav_weight_cap); tis = truncated, min(ρ, correction_cap); mis = masked, ρ inside [1/correction_cap, "
        "correction_cap] and 0 outside. ρ is already the whole trainer/engine ratio (at staleness 0 the "
        "mismatch alone, for a stale token times the policy's drift since), so tis and mis replace "
        "behav_weight_cap's rule rather than multiply a second weight on top (docs/engine.md)")
    correction_level: Literal["token", "sequence"] = Field(
        "token", description="correction tis/mis: token = each token's own ratio; sequence = the sequence's "
        "ratio exp(Σ log ρ_t), truncated or masked as a whole, on every one of its tokens")
    correction_cap: float = Field(2.0, gt=1, description="correction tis/mis: the truncation cap, and the band "
                                  "[1/cap, cap] outside which mis masks")
    normalize: Literal["tokens", "batch"] = "tokens"
    adv_std_norm: bool = False
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    minibatches: Optional[int] = Field(
        None, ge=1, le=1024, description="optimiser steps per batch (its samples split evenly); π_prox of "
        "decoupled PPO stays fixed at the start of the batch. Left out: 2 for loss ppo, so that its clip can bind "
        "(with one step π_prox is the policy being differentiated, and ppo is REINFORCE with a behaviour "
        "weight), 1 for reinforce and with schedule.stream_train (bench/minibatches.py). Two steps move the "
        "policy about twice as far per batch as one: at lr 5e-5 they learned as fast or faster on every model "
        "tried, and two steps at half the lr matched one step (bench/defaults.py); a run that peaks and falls "
        "back wants fewer steps or a lower lr")
    ppo_epochs: int = Field(1, ge=1, le=64, description="passes over each batch, each split into minibatches")
    drop_uniform_groups: bool = Field(False, description="async: skip prompt groups whose rewards are all equal "
                                      "(zero advantages) and fill the batch with others (DAPO's dynamic sampling)")
    advantage: Literal["group", "gae"] = Field(
        "group", description="group: GRPO's reward minus its prompt group's mean; gae: a critic (a value model "
        "trained beside the policy, see critic) and GAE(gamma, lam) per token, as PPO-RLHF does")
    gamma: float = Field(1.0, ge=0, le=1, description="gae: the discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="gae: the bias/variance trade-off of GAE (1 = Monte Carlo "
                       "returns minus the value, 0 = one-step TD)")
    whiten_advantages: bool = Field(
        True, description="gae: whiten the per-token advantages, (A − mean) / (std + 1e-8), the mean and the "
        "(population) std over all the generated tokens of the step's batch, across data-parallel ranks, as verl, "
        "OpenRLHF and TRL do (a critic that starts at 0 and rewards in [0, 1] otherwise make every early "
        "advantage >= 0); the critic's returns stay raw. With schedule.stream_train the same whole-batch "
        "whitening is applied to the step's gradients at its end (needs trainer.zero_stage 0, not float16). "
        "advantage group ignores it (GRPO centres each prompt group already; adv_std_norm "
        "scales it)")

    @model_validator(mode="after")
    def _kl_in_the_reward_needs_gae(self):
        if self.kl_penalty == "reward" and self.advantage != "gae":
            raise ValueError("algorithm.kl_penalty 'reward' adds the KL to the per-token rewards of GAE: it needs "
                             "algorithm.advantage 'gae' (group advantages have one reward per sequence)")
        return self




class RolloutSpec(_Strict):
    engines: int = Field(1, ge=1, le=4096, description="rollout engines (each tensor_parallel GPUs on GPUs)")
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS, description="tokens generated per completion at most: at "
                            "most 262,144, and below max_model_len (the model's context), checked when the run plans")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 = all tokens")
    stop: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(default_factory=list, max_length=16, description="stop strings (kept in the "
                            "completion, so the text scored is exactly the tokens trained on)")
    max_model_len: Optional[int] = Field(None, ge=16, description="prompt + completion tokens; default: the "
                                         "model's own limit. Longer prompts are skipped and counted")
    # keep: pause with KV cache, load, resume (PipelineRL in-flight update)
    # interrupt: abort, load, resubmit prompt+prefix (AReaL)
    # drain: let running requests finish before loading (update between requests)
    update_mode: Literal["keep", "interrupt", "drain"] = "keep"
    max_num_seqs: int = Field(256, ge=1)
    # score each sample the moment it finishes, overlapped with generation (RLHFuse's
    # inter-stage fusion); off = score the whole batch after generation, at a barrier
    fused_scoring: bool = True
    migrate_tail: int = Field(0, ge=0, description="sync mode with 2+ engines: once this few requests remain, "
                              "move some from the busiest engine to the idlest (RLHFuse); 0 = off")
    gather_tail: int = Field(0, ge=0, description="sync mode with 2+ engines: once this few requests remain in "
                             "all, move them onto the engine running the most, so the other engines' cores are free "
                             "for the inference stage (scoring, reward model, reference, critic) while the tail "
                             "finishes (RLHFuse's inter-stage fusion); 0 = off. Not with migrate_tail")
    kv_cache_gb: float = Field(1.0, gt=0)
    rpc_timeout_s: float = Field(60.0, gt=0, description="a weight update an engine has not acknowledged after this "
                                 "long fails the run (a wedged engine) instead of hanging it")
    # rpc: the state dict as safetensors bytes through each engine's RPC; collective: a
    # torch.distributed broadcast from the trainer to every engine (gloo on CPU, NCCL
    # between GPUs; workers/weights/broadcast.py)
    weight_transport: Literal["collective", "rpc"] = "rpc"
    cpu_single_process: Optional[bool] = Field(None, description="vLLM on a CPU: run the model in the engine's own "
                                               "process, with no engine core or worker process (they spin-wait on "
                                               "each other). Default: on for engine servers (resources."
                                               "engine_processes, the default: 1.12x faster async runs on 2 cores), "
                                               "off for an engine inside the coordinator (it would share the "
                                               "trainer's interpreter lock) and for tensor_parallel > 1")
    enforce_eager: Optional[bool] = Field(None, description="vLLM without CUDA graphs or torch.compile. Default: "
                                          "eager on the CPU (compiling there costs minutes at start-up), CUDA graphs "
                                          "on GPUs (faster decoding; memory for the graphs and seconds to capture "
                                          "them at start-up); true: eager everywhere, false: compiled on the CPU too")
    group_requests: bool = Field(True, description="send a prompt group to its engine as one request of group_size "
                                 "samples (vLLM parallel sampling); off = one request per sample. Interrupt updates "
                                 "and migrate_tail or gather_tail always use one request per sample")
    share_engines: bool = Field(False, description="model.lora runs: join this node's shared engine pools instead "
                                "of starting engines of its own. Runs of any team on the same base model and "
                                "engine settings share one vLLM engine per rollout engine, each run's adapter in a "
                                "slot of its own, generation shared fairly by team weight "
                                "(docs/guides/shared-engines.md)")


class LongTailSpec(_Strict):
    """schedule.dispatch skew_aware: the long-tail engines and the requests' priorities."""
    share: float = Field(0.1, gt=0, lt=1, description="the share of prompt groups, by predicted length against "
                         "the recent predictions, that go to the long-tail engines")
    engines: Optional[int] = Field(None, ge=1, description="long-tail engines; default: chosen after every step "
                                   "from the two roles' measured tokens per second, so that both pools finish "
                                   "their predicted tokens together (at least 1, and 1 less than the engines)")
    aging: Optional[int] = Field(None, ge=0, description="vLLM priority: a predicted-short group waits behind at "
                                 "most this many groups dispatched after it; default: schedule.batch_prompts")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="with engines set (a fixed split): the long-tail "
                                        "engines' own vLLM max_num_seqs, a small batch configured for latency as "
                                        "StreamRL's; default: rollout.max_num_seqs (their batch is then small because "
                                        "only the predicted-longest share reaches them)")

    @model_validator(mode="after")
    def _own_batch_needs_a_fixed_split(self):
        if self.max_num_seqs is not None and self.engines is None:
            raise ValueError("schedule.long_tail.max_num_seqs configures the long-tail engines when they start: set "
                             "long_tail.engines too (without it the split moves between steps)")
        return self


class ScheduleSpec(_Strict):
    mode: Literal["sync", "async"] = "async"
    max_staleness: int = Field(2, ge=0)
    batch_prompts: int = Field(8, ge=1, description="prompts per training step (x group_size samples)")
    # fifo | random | longest_first (a task order by an output-length ranker learned online
    # from the run's own samples) | skew_aware (StreamRL's skewness-aware dispatch: long-tail
    # engines, vLLM priorities with aging)
    dispatch: Literal["fifo", "random", "longest_first", "skew_aware"] = "fifo"
    long_tail: LongTailSpec = LongTailSpec()
    # sync mode only: train on each prompt group as soon as it is scored, overlapping the
    # first micro-batches with the tail of generation (StreamRL's stream generation)
    stream_train: bool = False


class PipelineSpec(_Strict):
    """RLHFuse's intra-stage fusion as the trainer of a GAE run (workers/train/pipeline_trainer.py)."""
    stages: int = Field(1, ge=1, le=16, description="pipeline stages the actor and the critic are split into by "
                        "layers, one rank process each, the critic's stages in the opposite direction; 1 = no "
                        "pipeline (DeepSpeed's trainer)")
    schedule: Literal["fused", "sequential"] = Field(
        "fused", description="fused: both models' micro-batches in one schedule, each filling the other's "
        "bubbles; sequential: the actor's 1F1B pipeline, then the critic's")
    micro_batches: int = Field(8, ge=1, le=512, description="micro-batches per step (by length)")


class TrainerSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 0
    micro_batch_tokens: int = Field(4096, ge=16)
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                         "backward instead of keeping them (Hugging Face's gradient "
                                         "checkpointing): less memory, about one forward more per step")
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    pipeline: PipelineSpec = PipelineSpec()


class CriticSpec(_Strict):
    """The value model of algorithm.advantage 'gae': the policy's own model folder with a scalar
    head (initialised to 0) in place of the LM head, trained by its own DeepSpeed engine."""
    lr: Optional[float] = Field(None, gt=0, description="default: algorithm.lr")
    value_clip: float = Field(0.2, gt=0, description="how far one batch may move a value from the one its "
                              "advantages were computed with (PPO's clipped value loss)")
    zero_stage: Literal[0, 1, 2, 3] = 0
    forward: Literal["trainer", "stage"] = Field(
        "trainer", description="where the critic's no-grad forward (the values GAE is computed from) runs: inside "
        "the trainer's step, or in the inference stage, a worker process holding a copy of the critic that "
        "values each sample as it finishes generating (inference.*); the copy is reloaded after every step")


class StopSpec(_Strict):
    max_steps: int = Field(200, ge=1)
    max_minutes: float = Field(10.0, gt=0, le=MAX_RUN_MINUTES, description="training time at most (at most 30 "
                               "days); the evaluations before the first and after the last step are not counted, "
                               "each bounded by eval.timeout_minutes")


# eval/<set>/... beside these: a set may not be named like them (docs/architecture.md §5)
RESERVED_EVAL_SET_NAMES = ("accuracy", "sampled_reward", "part")


class EvalSetSpec(_Strict):
    """One held-out evaluation set (``eval.sets``): n completions per prompt sampled at a
    temperature, scored by the set's reward, reported as ``eval/<name>/pass@<k>`` (the
    unbiased estimator, Chen et al. 2021) and ``eval/<name>/avg@<n>`` (mean reward)."""
    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_.-]+$", description=(
        "the set's label in its metric names, eval/<name>/pass@<k>"))
    dataset: Optional[str] = Field(None, description="a JSONL file, a generator gen:<name>[?k=v&...] or, on the "
                                   "platform, a team dataset name[@version]; default: the run's own held-out split "
                                   "(task.eval_size rows)")
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    size: int = Field(200, ge=1, le=100_000, description="rows to generate for gen: datasets")
    seed: int = Field(1, description="the generator's seed (gen: datasets); another seed than task.seed gives "
                      "other rows")
    reward: Optional[RewardSpec] = Field(None, description="how the set's samples are scored (the forms of the "
                                         "run's reward section); default: the run's reward")
    prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts evaluated (the set's first ones)")
    n: int = Field(4, ge=1, le=256, description="completions sampled per prompt")
    k: list[int] = Field(default_factory=list, validate_default=True, description="pass@k reported for each k "
                         "(1 <= k <= n); default: 1 and n")
    temperature: Optional[float] = Field(None, ge=0, le=10, description="sampling temperature; default: "
                                         "rollout.temperature; 0 (greedy) needs n 1")
    pass_reward: float = Field(1.0, allow_inf_nan=False, description="a sample passes (counts as correct for "
                               "pass@k) when its reward is at least this")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_EVAL_SET_NAMES:
            raise ValueError(f"{name!r} is taken by eval/{name} metrics; choose another name")
        return name

    @field_validator("dataset")
    @classmethod
    def _set_generator_bounded(cls, value):
        if value is not None and value.startswith("gen:"):
            from workers.tasks.datasets import parse_generator

            parse_generator(value)
        return value

    @field_validator("k", mode="before")
    @classmethod
    def _one_k_is_a_list(cls, value):
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("k")
    @classmethod
    def _k_within_n(cls, ks: list[int], info) -> list[int]:
        n = info.data.get("n")
        if not ks and n is not None:
            return sorted({1, n})
        bad = [k for k in ks if k < 1 or (n is not None and k > n)]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= n ({n} samples per prompt); not {', '.join(map(str, bad))}")
        if len(set(ks)) != len(ks):
            raise ValueError("each k once")
        return sorted(ks)

    @field_validator("temperature")
    @classmethod
    def _greedy_is_one_sample(cls, temperature, info):
        if temperature == 0 and (info.data.get("n") or 1) > 1:
            raise ValueError(f"temperature 0 (greedy) gives n ({info.data['n']}) identical samples: set n 1, or a "
                             "temperature above 0")
        return temperature

    @field_validator("reward")
    @classmethod
    def _rule_rewards(cls, reward):
        if reward is not None and reward.model is not None:
            raise ValueError("a reward model (reward.model) is not supported in an evaluation set: leave the set's "
                             "reward out to score with the run's reward")
        return reward

    @model_validator(mode="after")
    def _generated_set_bounded(self):
        if self.dataset is not None and self.dataset.startswith("gen:"):
            from workers.tasks.datasets import parse_generator

            parse_generator(self.dataset, self.size)
        return self


class EvalSpec(_Strict):
    every_steps: int = Field(20, ge=0, description="0 = only before and after")
    prompts: int = Field(200, ge=0)
    timeout_minutes: float = Field(60.0, gt=0, le=MAX_RUN_MINUTES, description="each evaluation's time at most, "
                                   "the one before step 0 too: one that runs past it is stopped, reported as "
                                   "eval/timed_out 1 with no other eval metrics for that step, and the run goes on")
    samples: int = Field(0, ge=0, le=64, description="also sample this many completions per held-out prompt at "
                         "rollout.temperature: their mean reward is eval/sampled_reward (0 = greedy only)")
    sets: list[EvalSetSpec] = Field(default_factory=list, max_length=16, description=(
        "held-out sets evaluated with n samples per prompt (pass@k, avg@n), each with its own data and reward, "
        "at every evaluation beside eval/accuracy"))

    @field_validator("sets")
    @classmethod
    def _distinct_names(cls, sets: list[EvalSetSpec]) -> list[EvalSetSpec]:
        seen: dict[str, int] = {}
        for i, one in enumerate(sets):
            if one.name in seen:
                raise ValueError(f"sets {seen[one.name]} and {i} are both named {one.name!r}")
            seen[one.name] = i
        return sets


class ResourcesSpec(_Strict):
    """Where the run's processes go; workers/cluster/placement.py turns this and the machine into a
    plan (GPUs, memory share and CPU cores per process). The engine count stays
    ``rollout.engines``. ``gpus: N`` alone (older specs) means one node with N GPUs."""
    queue: Literal["cpu", "gpu"] = "cpu"
    gpus: int = Field(0, ge=0, description="GPUs for the run in all (nodes x gpus_per_node); 0 = what the "
                      "worker has")
    nodes: int = Field(1, ge=1, le=1024, description="machines the run spans; trainer ranks split evenly over them")
    gpus_per_node: Optional[int] = Field(None, ge=1, le=64, description="default: gpus / nodes, or all of the "
                                         "worker's")
    trainer_ranks: int = Field(1, ge=1, le=4096, description="trainer processes (DeepSpeed ranks), one GPU each")
    tensor_parallel: int = Field(1, ge=1, le=64, description="shards per rollout engine, each a vLLM worker "
                                 "process: GPUs per engine (one node's), or on a CPU the engine's cores split among "
                                 "them; the number of engines is rollout.engines")
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1, description="share of an engine GPU's "
                                                    "memory vLLM takes; default 0.9, 0.5 with colocate")
    engine_processes: Optional[bool] = Field(None, description="each rollout engine in a server process of its "
                                             "own, started from the plan with its devices, cores and memory share "
                                             "(workers/rollout/server.py). Default: yes (false is refused on GPUs, "
                                             "ignored with nodes > 1); false keeps a CPU run's engines inside the "
                                             "coordinator's process")
    trainer_process: bool = Field(False, description="the trainer in a process of its own even with one rank "
                                  "(always so with trainer_ranks > 1): it then shares no interpreter lock with "
                                  "the coordinator's event loop")
    colocate: bool = Field(False, description="engines share the trainer's GPUs (GPUs only), in a share of their "
                           "memory (gpu_memory_utilization, default 0.5): with schedule.mode sync they sleep through "
                           "each trainer step (vLLM sleep mode) and wake for the update; with async (or stream_train) "
                           "they generate beside the trainer's steps and take in-flight updates")
    inference_gpu: Literal["trainer", "engine", "own"] = Field(
        "trainer", description="GPU plans: where the inference stage's workers (reward.model, algorithm.kl_reference "
        "'stage', critic.forward 'stage') compute, all on node 0: 'trainer' shares trainer rank 0's GPU, 'engine' "
        "the first engine's (in what its vLLM share leaves), 'own' takes the next GPU after the trainer's and the "
        "engines'. The planner counts their weights and forwards there; CPU plans ignore it")

    @field_validator("nodes")
    @classmethod
    def _gpus_split_over_nodes(cls, nodes: int, info) -> int:
        from pydantic_core import PydanticCustomError

        gpus = info.data.get("gpus")
        if gpus and gpus % nodes:
            raise PydanticCustomError("resources_nodes", "resources.gpus ({gpus}) do not split evenly over {nodes} "
                                      "nodes", {"gpus": gpus, "nodes": nodes})
        return nodes

    @field_validator("gpus_per_node")
    @classmethod
    def _gpus_agree(cls, per_node: Optional[int], info) -> Optional[int]:
        from pydantic_core import PydanticCustomError

        gpus, nodes = info.data.get("gpus"), info.data.get("nodes")
        if per_node is not None and gpus and nodes and gpus != nodes * per_node:
            raise PydanticCustomError("resources_gpus", "resources.gpus is {gpus} but nodes x gpus_per_node is "
                                      "{nodes} x {per_node} = {total}: give one of them, or make them agree",
                                      {"gpus": gpus, "nodes": nodes, "per_node": per_node, "total": nodes * per_node})
        return per_node


class InferenceSpec(_Strict):
    """The inference stage's workers (algorithm.kl_reference: stage, critic.forward: stage): processes of their own
    beside the coordinator, fed the samples that finish generating close together."""
    micro_batch: int = Field(32, ge=1, le=4096, description="samples per forward at most")
    max_wait_ms: float = Field(20.0, ge=0, le=10_000, description="how long a partial micro-batch waits for more")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="a forward slower than this fails the run")
    threads: int = Field(1, ge=1, le=256, description="CPU threads of each stage worker")
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 22, description="padded tokens per forward at most: a "
                                    "micro-batch longer than this is split into forwards that fit, so the KL "
                                    "reference's full-vocabulary logits stay within what the planner counts")


def _switch(value):
    """``tensorboard: true`` is ``tensorboard: {}`` (all defaults); ``false`` is off."""
    if value is True:
        return {}
    return None if value is False else value


class TensorBoardReport(_Strict):
    dir: str = Field("tensorboard", min_length=1, max_length=1000, description="the event files' folder; relative: "
                     "under the run's output folder")


class MlflowReport(_Strict):
    tracking_uri: Optional[str] = Field(None, min_length=1, max_length=1000, description=(
        "an MLflow server (http://host:5000), or a local folder: a file store, which works offline (relative: "
        "under the run's output folder). Default: $MLFLOW_TRACKING_URI where the engine runs, else 'mlruns' in "
        "the run's output folder"))
    experiment: str = Field("fluxrl", min_length=1, max_length=250, description="the experiment, created if missing")
    run_name: Optional[str] = Field(None, min_length=1, max_length=250, description="default: the spec's name")
    tags: dict[str, str] = Field(default_factory=dict, max_length=100, description="tags set on the MLflow run")

    @field_validator("tracking_uri")
    @classmethod
    def _one_server(cls, uri: Optional[str]) -> Optional[str]:
        # a server URI must name one host to every parser that reads it, and carry no
        # credentials: those come from the environment where the engine runs, never a spec
        from pydantic_core import PydanticCustomError

        if uri is not None and uri.partition("://")[0].strip().lower() in ("http", "https"):
            problem = check_server_uri(uri)[1]
            if problem:
                raise PydanticCustomError("tracking_uri", "{problem}", {"problem": problem})
        return uri


class WandbReport(_Strict):
    project: str = Field("fluxrl", min_length=1, max_length=128)
    entity: Optional[str] = Field(None, min_length=1, max_length=128, description="team or user (online mode)")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written to <dir>/wandb/offline-run-*, uploaded later by `wandb sync`; "
        "online: streamed to W&B (needs WANDB_API_KEY and the network where the engine runs)")
    dir: str = Field(".", min_length=1, max_length=1000, description="where wandb/ is written; relative: under "
                     "the run's output folder")
    name: Optional[str] = Field(None, min_length=1, max_length=250, description="default: the spec's name")
    group: Optional[str] = Field(None, min_length=1, max_length=128)
    tags: list[str] = Field(default_factory=list, max_length=64)


class ReportSpec(_Strict):
    """Where a run's metric points go besides metrics.jsonl and the platform: each exporter set
    here gets every point the dashboard gets (workers/io/exporters.py). One that fails is
    logged and dropped; training goes on."""
    tensorboard: Optional[TensorBoardReport] = Field(None, description="TensorBoard event files")
    mlflow: Optional[MlflowReport] = Field(None, description="an MLflow run")
    wandb: Optional[WandbReport] = Field(None, description="a Weights & Biases run (offline by default)")

    @field_validator("tensorboard", "mlflow", "wandb", mode="before")
    @classmethod
    def _on_off(cls, value):
        return _switch(value)

    def enabled(self) -> list[str]:
        return [name for name in ("tensorboard", "mlflow", "wandb") if getattr(self, name) is not None]


_SERVER_AUTHORITY = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def check_server_uri(uri: str) -> tuple[Optional[str], Optional[str]]:
    """``(origin, None)`` for an http(s) URI naming one server, ``origin`` being
    ``scheme://host:port`` (lower case, the default port filled in); ``(None, why not)``
    otherwise. The URI is read by urllib3's parser, the one MLflow's client connects with,
    and refused wherever two readers could disagree on the host: a backslash (urllib3 ends
    the authority there, urlsplit does not), spaces and control characters, '%' escapes,
    userinfo ('user:password@': credentials never come from a spec), a query or fragment."""
    from urllib.parse import urlsplit

    from urllib3.exceptions import LocationParseError
    from urllib3.util import parse_url

    if not uri.isascii() or any(c == "\\" or c.isspace() or not c.isprintable() for c in uri):
        return None, "an MLflow server URI must not contain backslashes, spaces, control or non-ASCII characters"
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None, "an MLflow server (http:// or https://) or a folder inside the run's output folder"
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return None, ("credentials do not belong in the URI: the operator sets them where the engine runs "
                      "(MLFLOW_TRACKING_USERNAME and _PASSWORD, or MLFLOW_TRACKING_TOKEN)")
    if "?" in rest or "#" in rest:
        return None, "an MLflow server URI is scheme://host:port[/path], without a query or fragment"
    if not _SERVER_AUTHORITY.fullmatch(authority):
        return None, "an MLflow server URI's host is letters, digits, '.' and '-' (or [IPv6]), then :port"
    try:
        parsed, split = parse_url(uri), urlsplit(uri)
        port = parsed.port or {"http": 80, "https": 443}[scheme.lower()]
        same = (parsed.host or "").strip("[]").lower() == (split.hostname or "") and parsed.port == split.port
    except (LocationParseError, ValueError):
        return None, "not a URI"
    if parsed.auth is not None or not parsed.host or not same or not 0 < port < 65536:
        return None, "an MLflow server URI is scheme://host:port[/path]"
    from workers.io.exporters import connected_origin  # the origin as the exporter compares it

    return connected_origin(uri), None


def server_origin(uri: str) -> Optional[str]:
    """``scheme://host:port`` of an http(s) URI that check_server_uri accepts, or None."""
    return check_server_uri(uri)[0]


def report_paths_outside_run(report: ReportSpec, mlflow_servers: Optional[list[str]] = None
                             ) -> list[dict[str, str]]:
    """The exporter folders of ``report`` that would leave the run's output folder (an
    absolute path, '..', a file: URI), as SpecError entries: the platform refuses them, a
    run there may write only inside its own folder. An MLflow server URI must be one of
    ``mlflow_servers`` (origins, the platform's FLUXRL_MLFLOW_SERVERS) where that is given:
    a worker posts to it from inside the cluster, so a team may not aim it at an address of
    its choosing (the metadata service, an internal API)."""
    import posixpath

    def outside(path: str) -> bool:
        return posixpath.isabs(path) or path.startswith("~") or ".." in posixpath.normpath(path).split("/")

    errors = []
    for name in ("tensorboard", "wandb"):
        section = getattr(report, name)
        if section is not None and outside(section.dir):
            errors.append({"field": f"report.{name}.dir", "message": "must be a folder inside the run's output "
                           "folder (relative, without '..')"})
    uri = report.mlflow.tracking_uri if report.mlflow is not None else None
    if uri is not None and ("://" in uri or uri.partition(":")[0] in ("file", "sqlite", "databricks")):
        origin, problem = check_server_uri(uri)
        if origin is None:
            errors.append({"field": "report.mlflow.tracking_uri", "message": problem})
        elif mlflow_servers is not None and origin not in {server_origin(a) for a in mlflow_servers}:
            # the whole origin (scheme, host, port as the connecting parser reads them) must be listed
            allowed = ", ".join(mlflow_servers) or "none: set FLUXRL_MLFLOW_SERVERS"
            errors.append({"field": "report.mlflow.tracking_uri", "message": f"{origin} is not an MLflow server this "
                           f"deployment allows (FLUXRL_MLFLOW_SERVERS: {allowed}); a folder inside the run's output "
                           "folder always works"})
    elif uri is not None and outside(uri):
        errors.append({"field": "report.mlflow.tracking_uri", "message": "must be a folder inside the run's output "
                       "folder (relative, without '..'), or an MLflow server (http:// or https://)"})
    return errors


def _mlflow_on_a_server(section: MlflowReport) -> bool:
    """Whether the MLflow run goes to a server: an http(s) URI, or none (the worker's
    MLFLOW_TRACKING_URI, the operator's server on a deployment); a folder is the run's own."""
    uri = section.tracking_uri
    return uri is None or uri.partition("://")[0].strip().lower() in ("http", "https")


def report_outside_namespace(report: ReportSpec, mlflow_prefix: str = "", wandb_prefix: str = "",
                             wandb_entity: str = "") -> list[dict[str, str]]:
    """The tracker names ``report`` sets outside a team's namespace on a shared tracker, as
    SpecError entries: an MLflow experiment on a server not starting with ``mlflow_prefix``;
    in W&B online mode (the worker uploads with the operator's key) a project not starting
    with ``wandb_prefix``, or an entity other than ``wandb_entity``. Letter case is ignored
    (W&B names are not case-sensitive). An empty prefix or entity sets no rule; names the
    report leaves unset are not checked (namespace_defaults gives them)."""
    def inside(name: str, prefix: str) -> bool:
        return name.casefold().startswith(prefix.casefold())

    errors = []
    mlflow, wandb = report.mlflow, report.wandb
    if (mlflow is not None and mlflow_prefix and _mlflow_on_a_server(mlflow) and "experiment" in mlflow.model_fields_set
            and not inside(mlflow.experiment, mlflow_prefix)):
        errors.append({"field": "report.mlflow.experiment", "message": f"the team's MLflow experiments are named "
                       f"'{mlflow_prefix}...' on the shared server: name it '{mlflow_prefix}{mlflow.experiment}', or "
                       "leave it out for the team's default"})
    if wandb is not None and wandb.mode == "online":
        if wandb_prefix and "project" in wandb.model_fields_set and not inside(wandb.project, wandb_prefix):
            errors.append({"field": "report.wandb.project", "message": f"the team's W&B projects are named "
                           f"'{wandb_prefix}...': name it '{wandb_prefix}{wandb.project}', or leave it out for the "
                           "team's default"})
        if wandb_entity and wandb.entity is not None and wandb.entity.casefold() != wandb_entity.casefold():
            errors.append({"field": "report.wandb.entity", "message": f"runs here log to the W&B entity "
                           f"'{wandb_entity}' (the operator's): leave it out, or give that one"})
    return errors


def namespace_defaults(report: ReportSpec, mlflow_prefix: str = "", wandb_prefix: str = "",
                       wandb_entity: str = "") -> dict[str, dict[str, str]]:
    """The names to fill in where ``report`` leaves them unset, so that they fall in the
    team's namespace: the usual default ('fluxrl') under the prefix, the operator's entity."""
    filled: dict[str, dict[str, str]] = {}
    mlflow, wandb = report.mlflow, report.wandb
    if (mlflow is not None and mlflow_prefix and _mlflow_on_a_server(mlflow)
            and "experiment" not in mlflow.model_fields_set):
        filled["mlflow"] = {"experiment": mlflow_prefix + MlflowReport.model_fields["experiment"].default}
    if wandb is not None and wandb.mode == "online":
        if wandb_prefix and "project" not in wandb.model_fields_set:
            filled.setdefault("wandb", {})["project"] = wandb_prefix + WandbReport.model_fields["project"].default
        if wandb_entity and wandb.entity is None:
            filled.setdefault("wandb", {})["entity"] = wandb_entity
    return filled


class RunSpec(_Strict):
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec
    task: TaskSpec
    reward: RewardSpec = RewardSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    rollout: RolloutSpec = RolloutSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    trainer: TrainerSpec = TrainerSpec()
    critic: CriticSpec = CriticSpec()
    inference: InferenceSpec = InferenceSpec()
    stop: StopSpec = StopSpec()
    eval: EvalSpec = EvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    report: ReportSpec = Field(ReportSpec(), description="metric exporters: TensorBoard, MLflow, W&B")
    seed: int = 0

    @model_validator(mode="after")
    def _stream_needs_exact_scaling(self):
        if self.algorithm.minibatches is None:  # the default depends on the loss and the schedule
            one = self.algorithm.loss != "ppo" or self.schedule.stream_train or self.trainer.pipeline.stages > 1
            self.algorithm.minibatches = 1 if one else DEFAULT_PPO_MINIBATCHES
        if self.rollout.gather_tail and self.rollout.migrate_tail:
            raise ValueError("rollout.gather_tail and rollout.migrate_tail pull a step's tail opposite ways (onto "
                             "the fewest engines, or spread to the idlest): choose one")
        if self.schedule.stream_train and self.schedule.mode != "sync":
            raise ValueError("schedule.stream_train applies to schedule.mode 'sync' (async mode streams already)")
        if self.algorithm.drop_uniform_groups and self.schedule.mode != "async":
            raise ValueError("algorithm.drop_uniform_groups needs schedule.mode 'async' (a synchronous step "
                             "trains on the batch it generated; there is nothing to fill the gap with)")
        if self.algorithm.drop_uniform_groups and self.algorithm.group_size < 2:
            raise ValueError("algorithm.drop_uniform_groups needs algorithm.group_size >= 2 (a group of one "
                             "is always uniform)")
        if self.schedule.stream_train and (self.algorithm.minibatches > 1 or self.algorithm.ppo_epochs > 1):
            raise ValueError("schedule.stream_train trains each batch in one optimiser step: "
                             "algorithm.minibatches and ppo_epochs must be 1")
        whiten_later = (self.schedule.stream_train and self.algorithm.advantage == "gae"
                        and self.algorithm.whiten_advantages)
        if whiten_later and (self.trainer.zero_stage != 0 or self.model.dtype == "float16"):
            # the step whitens over the whole batch only at its end, from gradients accumulated
            # apart in p.grad (workers/train/trainer.py, "whiten_advantages in a streamed GAE step")
            raise ValueError("schedule.stream_train with algorithm.advantage 'gae' and whiten_advantages needs "
                             "trainer.zero_stage 0 and a model.dtype other than float16: the advantages are "
                             "whitened over the whole batch at the step's end, from gradients kept apart in "
                             "p.grad, which ZeRO 1-3 partition and fp16 loss-scales (or set "
                             "algorithm.whiten_advantages false)")
        return self

    @model_validator(mode="after")
    def _a_pipeline_trains_actor_and_critic(self):
        """What the pipeline trainer does not do (workers/train/pipeline_trainer.py): refused by name."""
        if self.trainer.pipeline.stages == 1:
            return self
        refusals = [
            (self.algorithm.advantage != "gae", "algorithm.advantage 'gae' (it fuses the actor's and the critic's "
             "training; without a critic use the DeepSpeed trainer)"),
            (self.trainer.zero_stage != 0 or self.critic.zero_stage != 0, "trainer.zero_stage and "
             "critic.zero_stage 0 (its stages are not DeepSpeed engines)"),
            (self.model.dtype not in ("auto", "float32"), "model.dtype float32 (its stages train in fp32 on the "
             "CPU)"),
            (self.algorithm.minibatches > 1 or self.algorithm.ppo_epochs > 1, "algorithm.minibatches and "
             "ppo_epochs 1 (one optimiser step per batch)"),
            (self.schedule.stream_train, "schedule.stream_train off"),
            (self.algorithm.kl_coef > 0 and self.algorithm.kl_reference != "stage", "algorithm.kl_reference "
             "'stage' with kl_coef > 0 (the reference is not split into stages; the inference stage brings "
             "its log-probs)"),
            (self.resources.trainer_ranks > 1 or self.resources.nodes > 1, "resources.trainer_ranks 1 and "
             "nodes 1 (its ranks are the stages)"),
        ]
        wrong = [need for bad, need in refusals if bad]
        if wrong:
            raise ValueError("trainer.pipeline.stages > 1 needs " + "; ".join(wrong))
        return self

    @model_validator(mode="after")
    def _lora_fits(self):
        """What a LoRA run does not do (yet), refused by the field that asks for it."""
        if self.model.lora is None:
            return self
        refusals = [
            (self.trainer.pipeline.stages > 1, "trainer.pipeline.stages 1 (the pipeline trainer's stages train the "
             "full model)"),
            (self.trainer.zero_stage == 3, "trainer.zero_stage 0, 1 or 2 (ZeRO-3 would shard a frozen base model "
             "that every rank needs whole for its forward: nothing to gain, not supported)"),
            (self.algorithm.advantage == "gae", "algorithm.advantage 'group' (a critic is a full second model; "
             "LoRA with a critic is not supported yet)"),
            (self.rollout.weight_transport == "collective", "rollout.weight_transport 'rpc' (the adapter is a "
             "file of a few MB that vLLM loads as a LoRA; the collective path writes full weights)"),
            (self.resources.colocate, "resources.colocate false (not supported with LoRA yet)"),
        ]
        wrong = [need for bad, need in refusals if bad]
        if wrong:
            raise ValueError("model.lora needs " + "; ".join(wrong))
        return self

    @model_validator(mode="after")
    def _shared_engines_fit(self):
        """What a run on shared engine pools needs, refused by the field that asks for it."""
        if not self.rollout.share_engines:
            return self
        refusals = [
            (self.model.lora is None, "model.lora (runs share the base model; each brings its adapter)"),
            (self.rollout.update_mode == "drain", "rollout.update_mode 'keep' or 'interrupt' (a drain would wait "
             "for the other runs' requests too)"),
            (self.resources.nodes > 1, "resources.nodes 1 (pools serve the runs of their own node)"),
            (self.resources.engine_processes is False, "resources.engine_processes left on (a pool is a process "
             "of its own)"),
            (self.schedule.dispatch == "skew_aware", "schedule.dispatch other than 'skew_aware' (its priorities "
             "order one run's requests; on a shared engine vLLM would compare them with other runs' and preempt "
             "theirs)"),
            (self.algorithm.group_size > self.rollout.max_num_seqs, f"algorithm.group_size at most "
             f"rollout.max_num_seqs ({self.algorithm.group_size} > {self.rollout.max_num_seqs}: the pool's engine "
             f"has that many seats, shared with the other runs)"),
        ]
        wrong = [need for bad, need in refusals if bad]
        if wrong:
            raise ValueError("rollout.share_engines needs " + "; ".join(wrong))
        return self

    @model_validator(mode="after")
    def _critic_beside_one_trainer(self):
        if self.algorithm.advantage == "gae" and self.resources.nodes > 1:
            raise ValueError("algorithm.advantage 'gae' runs on one node for now (resources.nodes 1): its critic "
                             "trains beside each trainer rank there, but has not been tried across nodes")
        return self

    @model_validator(mode="after")
    def _a_critic_stage_needs_a_critic(self):
        if self.critic.forward == "stage" and self.algorithm.advantage != "gae":
            raise ValueError("critic.forward 'stage' runs the critic's forward, which only algorithm.advantage "
                             "'gae' has: set advantage gae, or leave critic.forward out")
        return self

    @model_validator(mode="after")
    def _a_reference_stage_needs_a_reference(self):
        if self.algorithm.kl_reference == "stage" and self.algorithm.kl_coef == 0:
            raise ValueError("algorithm.kl_reference 'stage' runs the KL reference's forward, which only "
                             "algorithm.kl_coef > 0 uses: set kl_coef, or leave kl_reference out")
        return self

    @model_validator(mode="after")
    def _held_out_sets_need_a_held_out_split(self):
        for i, one in enumerate(self.eval.sets):
            if one.dataset is None and self.task.eval_size == 0:
                raise ValueError(f"eval.sets.{i} ({one.name}) has no dataset, so it evaluates the run's held-out "
                                 "split, but task.eval_size is 0: give the set a dataset, or hold rows out")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def validate_spec(data: Any) -> RunSpec:
    """Validate a dict (or YAML/JSON text) into a RunSpec, or raise SpecError naming fields."""
    if isinstance(data, (str, bytes)):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise SpecError([{"field": "(document)", "message": f"not valid YAML/JSON: {exc}"}]) from None
    if not isinstance(data, dict):
        raise SpecError([{"field": "(document)", "message": "a run spec must be a mapping"}])
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(document)"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            errors.append({"field": field, "message": msg})
        raise SpecError(errors) from None


@dataclass(frozen=True)
class RunWork:
    """The most tokens a run can generate (every completion at rollout.max_tokens), by what
    generates them; the platform's per-run ceilings bound these (fluxrl/quotas/services.py)."""
    training: int  # stop.max_steps x schedule.batch_prompts x algorithm.group_size x max_tokens
    evaluations: int  # before step 0, every eval.every_steps before the last step, after the last step
    greedy: int  # one evaluation's held-out prompts x (1 greedy + eval.samples) x max_tokens
    sets: tuple[int, ...]  # one evaluation of each eval set: its prompts x n x max_tokens

    @property
    def per_evaluation(self) -> int:
        return self.greedy + sum(self.sets)

    @property
    def evaluation_total(self) -> int:
        return self.per_evaluation * self.evaluations

    @property
    def total(self) -> int:
        return self.training + self.evaluation_total


def run_work(spec: RunSpec) -> RunWork:
    """A run's total work from its spec (Python integers: no overflow). Prompts are those an
    evaluation can have: the run's held-out split has task.eval_size rows, a generated set
    its size; a file's rows are not known here, so its set counts eval.sets.prompts."""
    tokens = spec.rollout.max_tokens
    steps, every = spec.stop.max_steps, spec.eval.every_steps
    evaluations = 2 + ((steps - 1) // every if every else 0)
    held_out = spec.task.eval_size

    def set_prompts(one: EvalSetSpec) -> int:
        if one.dataset is None:
            return min(one.prompts, held_out)
        return min(one.prompts, one.size) if one.dataset.startswith("gen:") else one.prompts

    return RunWork(
        training=steps * spec.schedule.batch_prompts * spec.algorithm.group_size * tokens,
        evaluations=evaluations,
        greedy=min(spec.eval.prompts, held_out) * (1 + spec.eval.samples) * tokens,
        sets=tuple(set_prompts(one) * one.n * tokens for one in spec.eval.sets))


def load_spec_file(path: str) -> RunSpec:
    with open(path, encoding="utf-8") as fh:
        return validate_spec(fh.read())
