"""Tool calls are parsed from a turn in Qwen2's <tool_call> format, every malformed call
becoming an error (never an exception); the calculator evaluates arithmetic within its caps;
the Python tool runs code in the real OS sandbox and is cut off at each cap with its name."""
import json
import os

import pytest

from workers.agents.api import ToolCall
from workers.agents.tools import (
    TOOLS, CalculatorError, Limits, calculate, format_number, format_tool_call, parse_tool_calls, run_python,
    tool_call_format, tool_schemas,
)
from workers.rewards.sandbox_boundary import UNSAFE_ENV, boundary

CALC = {"calculator": TOOLS["calculator"]}
BOTH = {"calculator": TOOLS["calculator"], "python": TOOLS["python"]}


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# -- parsing -------------------------------------------------------------------------
def test_a_well_formed_call_is_parsed_with_its_arguments():
    text = "Let me compute it.\n" + call('{"name": "calculator", "arguments": {"expression": "347 * 29"}}')
    assert parse_tool_calls(text, CALC) == [ToolCall("calculator", {"expression": "347 * 29"})]


def test_arguments_given_as_a_json_string_are_parsed_too():
    text = call(json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "2+2"})}))
    assert parse_tool_calls(text, CALC) == [ToolCall("calculator", {"expression": "2+2"})]


def test_several_calls_in_a_turn_are_parsed_in_order():
    text = (call('{"name": "calculator", "arguments": {"expression": "1+1"}}') + " and "
            + call('{"name": "python", "arguments": {"code": "print(3)"}}'))
    assert parse_tool_calls(text, BOTH) == [ToolCall("calculator", {"expression": "1+1"}),
                                            ToolCall("python", {"code": "print(3)"})]


def test_a_turn_without_a_call_has_none():
    assert parse_tool_calls("The answer is 10063.", CALC) == []


@pytest.mark.parametrize("text, error", [
    (call('{"name": "calculator", "arguments": {"expression": "1+1"}'), "not valid JSON"),
    (call('["calculator"]'), 'must be a JSON object {"name": ..., "arguments": {...}}'),
    (call('{"name": "calculator", "arguments": "{oops"}'), "calculator: the arguments string is not valid JSON"),
    (call('{"name": "calculator", "arguments": [1, 2]}'), "calculator: the arguments must be a JSON object"),
    (call('{"name": "search", "arguments": {"q": "x"}}'), "unknown tool 'search'; the tools are: calculator"),
    (call('{"name": "calculator", "arguments": {}}'), "calculator: missing argument 'expression'"),
    (call('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}'),
     "calculator: unexpected argument 'x'; it takes expression"),
    (call('{"name": "calculator", "arguments": {"expression": 12}}'), "calculator: argument 'expression' must be a string"),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}', "unclosed <tool_call> tag"),
])
def test_a_malformed_call_becomes_an_error_not_an_exception(text, error):
    calls = parse_tool_calls(text, CALC)
    assert len(calls) == 1 and calls[0].error is not None
    assert error in calls[0].error


def test_an_unclosed_tag_after_a_good_call_keeps_the_good_call():
    text = call('{"name": "calculator", "arguments": {"expression": "1+1"}}') + "<tool_call>{"
    good, bad = parse_tool_calls(text, CALC)
    assert good == ToolCall("calculator", {"expression": "1+1"}) and "unclosed" in bad.error


def test_a_tool_not_offered_is_an_unknown_tool():
    text = call('{"name": "python", "arguments": {"code": "1"}}')
    assert parse_tool_calls(text, CALC)[0].error == "unknown tool 'python'; the tools are: calculator"


def test_the_written_call_parses_back():
    assert parse_tool_calls(format_tool_call("calculator", {"expression": "5*5"}), CALC) == [
        ToolCall("calculator", {"expression": "5*5"})]


def test_the_format_is_read_from_the_chat_template(tmp_path):
    declared = tmp_path / "declared"
    declared.mkdir()
    (declared / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}"}))
    silent = tmp_path / "silent"
    silent.mkdir()
    (silent / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tool_call_format(str(declared)) == "qwen2"
    assert tool_call_format(str(silent)) == "qwen2"  # the default, the format the tool list is written for


def test_schemas_name_each_tool_and_its_required_arguments():
    calc, py = tool_schemas(["calculator", "python"])
    assert calc["function"]["name"] == "calculator"
    assert calc["function"]["parameters"]["required"] == ["expression"]
    assert py["function"]["parameters"]["properties"]["code"]["type"] == "string"


# -- calculator ---------------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [
    ("347 * 29", "10063"),
    ("(12 + 8) * -3", "-60"),
    ("7 // 2 + 7 % 2", "4"),
    ("10 / 4", "2.5"),
    ("1 / 3", "0.333333333333"),
    ("2 ** 10", "1024"),
    ("-(2 ** -1)", "-0.5"),
    ("9 ** 99", str(9 ** 99)),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert format_number(calculate(expression)) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('ls')", "only numbers"),
    ("x + 1", "only numbers"),
    ("2 ** 1000", "the exponent 1000 is over 100"),
    ("99 ** 99", "the result is over 100 digits"),
    ("10 ** 60 * 10 ** 60", "the result is over 100 digits"),
    ("1 / 0", "division by zero"),
    ("1e308 * 10", "not a finite number"),
    ("1 +", "not an arithmetic expression"),
    ("1+" * 150 + "1", "over 200 characters"),
    ("(-8) ** 0.5", "not a real number"),
    ("True + 1", "only numbers"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(CalculatorError, match=error.replace("(", r"\(").replace("*", r"\*")):
        calculate(expression)


# -- python, in the real sandbox ----------------------------------------------------
@pytest.fixture(scope="module")
def os_boundary():
    if os.environ.get(UNSAFE_ENV) == "1":
        pytest.skip(f"{UNSAFE_ENV}=1: the operator chose to run user code without the OS sandbox")
    assert boundary().kind == "bwrap"


LIMITS = Limits(timeout_s=2.0, memory_mb=256, output_chars=300)


def test_python_returns_what_the_code_prints_and_a_last_expression(os_boundary):
    assert run_python("print(347 * 29)", LIMITS) == ("10063\n", None)
    assert run_python("x = 6\nx * 7", LIMITS) == ("42\n", None)


def test_python_that_hangs_is_killed_at_the_deadline(os_boundary):
    output, error = run_python("print('start', flush=True)\nwhile True: pass", LIMITS)
    assert error == "timeout"
    assert output == "start\n\n[killed: timed out after 2 s]"


def test_python_that_prints_megabytes_is_cut_at_the_output_cap(os_boundary):
    output, error = run_python("while True: print('x' * 1000)", LIMITS)
    assert error == "output_limit"
    assert output == "x" * 300 + "\n[output cut at 300 characters]"


def test_python_that_forks_is_refused_and_told_so(os_boundary):
    output, error = run_python("import os\nos.fork()", LIMITS)
    assert error == "PermissionError: sandbox: os.fork is not allowed in the sandbox"
    assert 'File "<python>", line 2' in output


def test_python_fork_is_refused_by_seccomp_with_the_audit_hook_switched_off(os_boundary):
    code = ("import sys\nsys.modules['__main__'].hook.__code__ = (lambda event, args: None).__code__\n"
            "import os\nos.fork()")
    output, error = run_python(code, LIMITS)
    assert error == "PermissionError: [Errno 1] Operation not permitted"


def test_python_over_its_memory_is_stopped(os_boundary):
    output, error = run_python("x = bytearray(600 * 2**20)", LIMITS)
    assert error == "memory" and output.rstrip().endswith("MemoryError")


def test_python_that_raises_returns_its_traceback(os_boundary):
    output, error = run_python("def f(x):\n    return 10 // x\nf(0)", LIMITS)
    assert error == "ZeroDivisionError: integer division or modulo by zero"
    # the code's own frames with their lines (the caret line under them varies by Python version)
    assert output.startswith('Traceback (most recent call last):\n  File "<python>", line 3, in <module>\n    f(0)\n'
                             '  File "<python>", line 2, in f\n    return 10 // x\n')
    assert output.endswith("\nZeroDivisionError: integer division or modulo by zero\n") and "<string>" not in output


def test_python_cannot_read_the_hosts_files(os_boundary):
    output, error = run_python("print(open('/etc/passwd').read())", LIMITS)
    assert error == "PermissionError: sandbox: reading /etc/passwd is not allowed"
