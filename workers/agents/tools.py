"""Tool calls parsed from a generated turn, and the built-in tools that answer them.

**The call format.** FluxRL reads tool calls in Qwen2's format (Hermes-style), the one its
chat template declares: a JSON object between tags in the assistant's turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347 * 29"}}
    </tool_call>

``arguments`` may also be a JSON string holding the object (models emit both). A turn may
hold several calls. Anything malformed (bad JSON, an unknown tool, a missing or extra
argument, an unclosed tag) becomes a ``ToolCall`` with ``error`` set, which the environment
answers as an error the model can read; parsing never raises.

``tool_call_format(model_path)`` reads the format from the model's chat template
(``FORMAT_MARKERS``); a template that declares none gets Qwen2's, the format the prompt's
tool list (``tool_schemas``) is rendered for. Another format is added by writing a parser
``(text) -> list[ToolCall]`` (name and arguments, unchecked), registering it in
``PARSERS`` and its template marker in ``FORMAT_MARKERS``.

**The tools.** ``calculator`` evaluates arithmetic by walking the expression's syntax tree
(never ``eval``), with caps on the expression's length, the exponent and the result's size.
``python`` runs code in the OS sandbox of workers/rewards/sandbox.py, a fresh child per call,
with the episode's CPU, memory, wall-clock and output caps (task.environment ``timeout_s``,
``memory_mb``, ``output_chars``); its output is what the code printed, or the traceback.
"""
from __future__ import annotations

import ast
import asyncio
import json
import logging
import math
import operator
import os
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

from workers.agents.api import ToolCall, ToolRecord

logger = logging.getLogger(__name__)

# -- the call format -----------------------------------------------------------------
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
MAX_CALLS_PER_TURN = 8  # calls past this in one turn are answered with an error, not run


def parse_qwen2(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` of ``text``, in order; an unclosed last tag
    is a malformed call."""
    calls, end = [], 0
    for match in _CALL.finditer(text):
        calls.append(_from_json(match.group(1)))
        end = match.end()
    if OPEN in text[end:]:
        calls.append(ToolCall("", {}, error=f"unclosed {OPEN} tag (no {CLOSE})"))
    return calls


def _from_json(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return ToolCall("", {}, error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, error='the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # a JSON string holding the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return ToolCall(name, {}, error=f"{name}: the arguments string is not valid JSON ({exc.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, error=f"{name}: the arguments must be a JSON object")
    return ToolCall(name, arguments)


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"qwen2": parse_qwen2}
# A chat template mentioning the marker declares the format.
FORMAT_MARKERS: dict[str, str] = {"qwen2": OPEN}
DEFAULT_FORMAT = "qwen2"


@lru_cache(maxsize=32)
def tool_call_format(model_path: str) -> str:
    """The tool-call format the model's chat template declares (tokenizer_config.json's
    ``chat_template`` or chat_template.jinja); Qwen2's where it declares none."""
    template = ""
    try:
        with open(os.path.join(model_path, "tokenizer_config.json"), encoding="utf-8") as fh:
            found = json.load(fh).get("chat_template") or ""
        template = found if isinstance(found, str) else " ".join(str(t.get("template", "")) for t in found)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open(os.path.join(model_path, "chat_template.jinja"), encoding="utf-8") as fh:
            template += fh.read()
    except OSError:
        pass
    for fmt, marker in FORMAT_MARKERS.items():
        if marker in template:
            return fmt
    logger.debug("the chat template of %s declares no tool-call format; using %s", model_path, DEFAULT_FORMAT)
    return DEFAULT_FORMAT


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it (Qwen2's format), e.g. for warm-start data."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def parse_tool_calls(text: str, tools: Optional[dict[str, Tool]] = None, fmt: str = DEFAULT_FORMAT) -> list[ToolCall]:
    """The turn's tool calls in format ``fmt``, each checked against ``tools`` (when given):
    an unknown tool, a missing, extra or non-string argument sets ``error``."""
    calls = PARSERS[fmt](text)
    if tools is None:
        return calls
    checked = []
    for call in calls:
        if call.error is None:
            tool = tools.get(call.name)
            error = (f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}"
                     if tool is None else tool.check(call.arguments))
            if error:
                call = ToolCall(call.name, call.arguments, error=error)
        checked.append(call)
    return checked


# -- the tools -----------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """A tool call's caps (from task.environment)."""
    timeout_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 4000


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, str]  # argument name -> its description; every argument is a required string
    run: Callable[[dict[str, Any], Limits], tuple[str, Optional[str]]]  # -> (output, error); blocking

    def check(self, arguments: dict[str, Any]) -> Optional[str]:
        missing = [p for p in self.parameters if p not in arguments]
        extra = [a for a in arguments if a not in self.parameters]
        if missing:
            return f"{self.name}: missing argument {missing[0]!r}"
        if extra:
            return f"{self.name}: unexpected argument {extra[0]!r}; it takes {', '.join(self.parameters)}"
        wrong = [p for p in self.parameters if not isinstance(arguments[p], str)]
        if wrong:
            return f"{self.name}: argument {wrong[0]!r} must be a string"
        return None

    def schema(self) -> dict:
        """The tool as the chat template's ``tools=`` argument takes it (JSON schema)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "required": list(self.parameters),
                           "properties": {p: {"type": "string", "description": d} for p, d in self.parameters.items()}}}}


async def run_tool_call(call: ToolCall, tools: dict[str, Tool], limits: Limits) -> ToolRecord:
    """Answer one parsed call: a malformed one with its error, a valid one by running the
    tool (off the event loop: the Python tool waits on a sandboxed process)."""
    started = time.perf_counter()
    if call.error is not None:
        return ToolRecord(call.name, call.arguments, f"error: {call.error}", call.error, 0.0)
    try:
        output, error = await asyncio.to_thread(tools[call.name].run, call.arguments, limits)
    except Exception as exc:  # the tool itself failed (e.g. no sandbox on this machine)
        logger.warning("tool %s failed: %s", call.name, exc)
        output, error = f"error: {type(exc).__name__}: {exc}", f"{type(exc).__name__}: {exc}"
    return ToolRecord(call.name, call.arguments, output, error, (time.perf_counter() - started) * 1000)


# -- calculator ------------------------------------------------------------------------
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_RESULT_DIGITS = 100
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses, unary
    minus. CalculatorError names what is refused (names, calls, a too big exponent or result)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is over {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression.strip()[:60]!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"the exponent {right} is over {MAX_EXPONENT}")
            if abs(left) > 1 and right > 0 and right * math.log10(abs(left)) > MAX_RESULT_DIGITS:
                raise CalculatorError(f"the result is over {MAX_RESULT_DIGITS} digits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        return _bounded(value)
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= 10 ** MAX_RESULT_DIGITS:
        raise CalculatorError(f"the result is over {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_number(value: int | float) -> str:
    """An int as is; a float to 12 significant digits, without a trailing .0 when whole."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _run_calculator(arguments: dict[str, Any], limits: Limits) -> tuple[str, Optional[str]]:
    try:
        return format_number(calculate(arguments["expression"])), None
    except CalculatorError as exc:
        return f"error: {exc}", str(exc)
    except RecursionError:
        return "error: the expression is nested too deeply", "the expression is nested too deeply"


# -- python ------------------------------------------------------------------------------
# After the sandbox's guards (workers/rewards/process.py CHILD_GUARDS): run the code as a
# script, printing a last bare expression's value as a REPL does; on an exception print the
# traceback (the code's own frames, with their lines) and exit 1 (3 for memory).
_PYTHON_CHILD = r'''
import ast, linecache
sys.stdout = out
linecache.cache["<python>"] = (len(code), None, code.splitlines(True), "<python>")
ns = {"__name__": "__main__"}
try:
    tree = ast.parse(code, "<python>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<python>", "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<python>", "eval"), ns)
        if value is not None:
            print(repr(value))
except SystemExit as exc:
    if exc.code not in (None, 0):
        print(f"SystemExit: {exc.code}")
    sys.stdout.flush()
    os._exit(0 if exc.code in (None, 0) else 1)
except BaseException as exc:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<python>"]
    print("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
          + "".join(traceback.format_exception_only(type(exc), exc)), end="")
    sys.stdout.flush()
    os._exit(3 if isinstance(exc, MemoryError) else 1)
sys.stdout.flush()
os._exit(0)
'''
MAX_PYTHON_CHILDREN = 8  # Python tool sandboxes at once in this process
_python_children = threading.BoundedSemaphore(MAX_PYTHON_CHILDREN)


def run_python(code: str, limits: Limits) -> tuple[str, Optional[str]]:
    """Run ``code`` in a fresh sandboxed child: (output, error). ``error`` is None, "timeout"
    (killed at the deadline), "output_limit" (cut at ``output_chars``), "memory", or the
    exception's last traceback line (a refused fork: PermissionError naming os.fork)."""
    from workers.rewards.process import SandboxedChild

    child = SandboxedChild(_PYTHON_CHILD, memory_mb=limits.memory_mb, cpu_s=max(1, math.ceil(limits.timeout_s)) + 1,
                           merge_stderr=True)
    with _python_children:
        try:
            child.start({"code": code, "where": "the sandbox"})
            child.end_input()
            raw, cut = child.read_all(limits.timeout_s, 4 * limits.output_chars)
            rc = child.wait() if cut is None else None
            exit_text = child.exit_text()
        finally:
            child.close()
    output = raw.decode("utf-8", errors="replace")
    if len(output) > limits.output_chars:
        output, cut = output[:limits.output_chars], "output_limit"
    if cut == "output_limit":
        return output + f"\n[output cut at {limits.output_chars} characters]", "output_limit"
    if cut == "timeout":
        return output + f"\n[killed: timed out after {limits.timeout_s:g} s]", "timeout"
    if rc == 0:
        return output, None
    if rc == 3:
        return output, "memory"
    if rc == 1:
        lines = [line for line in output.splitlines() if line.strip()]
        return output, (lines[-1] if lines else "the code raised an exception")
    if rc is not None and rc < 0 and "SIGXCPU" in exit_text:
        return output + f"\n[killed: CPU time over {limits.timeout_s:g} s]", "timeout"
    return output + f"\n[the process ended: {exit_text}]", f"process ended: {exit_text}"


def _run_python_tool(arguments: dict[str, Any], limits: Limits) -> tuple[str, Optional[str]]:
    return run_python(arguments["code"], limits)


TOOLS: dict[str, Tool] = {
    "calculator": Tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
                       {"expression": "the expression, e.g. 347 * 29"}, _run_calculator),
    "python": Tool("python", "Run Python code in a sandbox and return what it prints (the value of a last bare "
                   "expression is printed too).", {"code": "the Python source"}, _run_python_tool),
}


def tool_schemas(names: list[str]) -> list[dict]:
    """The named tools' schemas, for the chat template's ``tools=`` argument."""
    return [TOOLS[n].schema() for n in names]
