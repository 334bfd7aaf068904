"""The ``reward`` section: one function, a weighted sum of components, or a reward model."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from workers.spec.base import _Strict


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
