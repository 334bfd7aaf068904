"""An observation as token ids, rendered once by the model's chat template.

The ids of an episode are the prompt's, then each generated turn's exactly as the engine
produced them, then each observation's. An observation's ids are the chat template's text
for that message as it follows an assistant turn, plus the generation prompt of the next
assistant turn, tokenised once. Nothing generated is decoded and tokenised again.

The delta is found from two renderings with sentinel contents (in the bounded template
child, as every user-controlled template is rendered: workers/tasks/template_child.py):
``[user X]`` with the generation prompt, and ``[user X, assistant A, observation O]`` with
it. The second must start with the first (a template that rewrites earlier turns when a
message is added is not prefix-stable, and fails loudly); what follows ``A`` is the
end of the assistant's turn, the observation's header, ``O`` and the next generation
prompt. A turn that ended with the end-of-turn token already holds the first piece; a
turn cut by its length budget does not, and gets it from the observation.

Raw prompts (no chat template, e.g. the tiny model): an observation is its content and a
newline, tokenised by the model's tokenizer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from workers.agents.api import Observation

logger = logging.getLogger(__name__)

# Sentinels no template writes by itself (letters only: a template may trim the content).
_USER, _ASSISTANT, _OBSERVATION = "FluxUserQx7", "FluxAssistantQx7", "FluxObservationQx7"


class TemplateNotPrefixStable(ValueError):
    """A chat template renders earlier turns differently once a message is added: an
    observation cannot be appended as ids without re-tokenising the conversation."""


@dataclass(frozen=True)
class ChatDelta:
    """The text around an observation's content after an assistant turn's content:
    ``before`` (the end of the assistant's turn, the observation's header) and ``after``
    (the observation's end, the next assistant turn's generation prompt). ``wrap``: the
    content is wrapped as a tool response in a user message (a template without a tool role)."""
    before: str
    after: str
    role: str
    wrap: bool = False


def tool_response(content: str) -> str:
    """A tool's output as Qwen2's template writes it into a user message."""
    return f"<tool_response>\n{content}\n</tool_response>"


def chat_delta(render, role: str) -> ChatDelta:
    """The delta for an observation of ``role`` (``render(messages) -> text``, with the
    generation prompt). A template that refuses the role ``tool`` gets it as a user
    message wrapped in <tool_response>."""
    first = render([{"role": "user", "content": _USER}])
    try:
        second = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT},
                         {"role": role, "content": _OBSERVATION}])
        wrap = False
    except Exception as exc:  # noqa: BLE001 - the template raised for the role (raise_exception)
        if role != "tool":
            raise
        logger.info("the chat template has no tool role (%s): tool output renders as a user message", exc)
        second = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT},
                         {"role": "user", "content": tool_response(_OBSERVATION)}])
        wrap = True
    if not second.startswith(first):
        raise TemplateNotPrefixStable(
            "the chat template renders the conversation's start differently once an assistant turn and an "
            f"observation follow ({first[-60:]!r} is not a prefix of the longer rendering): agentic episodes "
            "append observations as ids and need a prefix-stable template")
    rest = second[len(first):]
    if not rest.startswith(_ASSISTANT) or rest.count(_OBSERVATION) != 1:
        raise TemplateNotPrefixStable("the chat template does not render an assistant turn's content right "
                                      "after the generation prompt, or renders an observation other than once")
    around = rest[len(_ASSISTANT):]
    if wrap:
        around = around.replace(tool_response(_OBSERVATION), _OBSERVATION)
    before, after = around.split(_OBSERVATION)
    return ChatDelta(before, after, "user" if wrap else role, wrap)


def _template_renderer(chat_template: str, special_tokens: dict):
    """``render(messages)`` in the bounded template child (the template is user input)."""
    from workers.tasks import template_child

    def render(messages: list[dict]) -> str:
        try:
            return template_child.render_rows([{"messages": messages}], chat_template=chat_template,
                                              special_tokens=special_tokens, prompt_format="chat")[0]
        except template_child.TemplateError as exc:
            raise ValueError(str(exc)) from None
    return render


class ObservationRenderer:
    """Observations → ids for one model (its tokenizer and chat template), the chat deltas
    rendered once per role and kept."""

    def __init__(self, tokenizer, chat_template: Optional[str] = None, special_tokens: Optional[dict] = None,
                 render=None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._render = render or (_template_renderer(chat_template, special_tokens or {}) if chat_template else None)
        self._deltas: dict[str, ChatDelta] = {}

    @classmethod
    def for_prompts(cls, prompts) -> "ObservationRenderer":
        """The renderer of a run's ``PromptRenderer`` (workers/tasks/prompts.py)."""
        from workers.tasks.prompts import _special_tokens

        template = prompts._chat_template() if prompts.has_chat_template else None
        return cls(prompts.tokenizer, template, _special_tokens(prompts.tokenizer))

    @property
    def prepared(self) -> bool:
        return self._render is None or {"tool", "user"} <= set(self._deltas)

    def prepare(self) -> None:
        """Render both roles' deltas now (each renders in a child process)."""
        if self._render is not None:
            self.delta("tool")
            self.delta("user")

    def delta(self, role: str) -> ChatDelta:
        if self._render is None:
            raise ValueError("a chat observation needs a chat template, and this model's tokenizer has none")
        if role not in self._deltas:
            self._deltas[role] = chat_delta(self._render, role)
        return self._deltas[role]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """A generated turn's text for the environment and the browser (special tokens left out)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def text(self, observation: Observation, chat: bool, turn_ids: Sequence[int], content: Optional[str] = None) -> str:
        """The text appended after a turn whose ids are ``turn_ids``: the observation
        (``content`` in place of its own when given) as the template renders it after that turn."""
        content = observation.content if content is None else content
        if not chat:
            return content + "\n"
        delta = self.delta(observation.role)
        before = delta.before
        last = self.tokenizer.decode(list(turn_ids[-1:]), skip_special_tokens=False) if turn_ids else ""
        if last and before.startswith(last):  # the turn ended with the end-of-turn token: it is there already
            before = before[len(last):]
        body = tool_response(content) if delta.wrap else content
        return before + body + delta.after

    def ids(self, observation: Observation, chat: bool, turn_ids: Sequence[int], max_tokens: int
            ) -> tuple[list[int], Observation]:
        """The observation's ids after a turn (``turn_ids``), and the observation as shown: its
        content cut so that the ids fit ``max_tokens`` (the template's own text is never cut),
        saying so at its end."""
        ids = self.encode(self.text(observation, chat, turn_ids))
        if len(ids) <= max_tokens:
            return ids, observation
        content_ids = self.encode(observation.content)
        overhead = max(0, len(ids) - len(content_ids))
        keep = max(0, max_tokens - overhead)
        while True:
            cut = len(content_ids) - keep
            note = f" [cut: {cut} of {len(content_ids)} tokens]"
            keep_note = max(0, keep - len(self.encode(note)))
            shown = self.decode(content_ids[:keep_note]) + note
            ids = self.encode(self.text(observation, chat, turn_ids, shown))
            if len(ids) <= max_tokens or keep_note == 0:
                return ids, Observation(shown, observation.role)
            keep -= max(1, len(ids) - max_tokens)
