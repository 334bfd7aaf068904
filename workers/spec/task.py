"""The ``task`` section: the dataset, how a row becomes a prompt, and the optional
multi-turn environment."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from workers.spec.base import MAX_TOKENS, _Strict

Tool = Literal["calculator", "python"]


def _calculator_only() -> list[Tool]:
    return ["calculator"]


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
    tools: list[Tool] = Field(
        default_factory=_calculator_only, max_length=8, description="tools the 'tools' environment offers "
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
