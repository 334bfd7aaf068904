"""Prompt templates (workers.tasks.prompts.compile_bounded, the template child's compiler):
every operation that can build far more than it is given refuses past MAX_TEMPLATE_RESULT,
when folded while compiling (a ValueError naming it) or when rendered (SecurityError),
before allocating; ordinary uses of the same filters and methods still work. Outside the
child, compile_template compiles nothing in the calling process."""
import resource

import pytest
from jinja2.exceptions import SecurityError, UndefinedError

from workers.tasks import prompts
from workers.tasks.prompts import compile_bounded, compile_template

BIG = 100_000_000


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("template", [
    f'{{{{ "x"|center({BIG}) }}}}', f'{{{{ "x"|indent({BIG}, true) }}}}', f'{{{{ "%{BIG}s"|format("x") }}}}',
    f'{{{{ [1]|batch({BIG}, 0)|list }}}}', f'{{{{ [1]|slice({BIG})|list }}}}', f'{{{{ {{"a": 1}}|tojson({BIG}) }}}}',
])
def test_width_filters_folded_while_compiling_are_refused_at_compile_time(template):
    before = peak_mb()
    with pytest.raises(ValueError, match="would build more than 100000"):
        compile_bounded(template)
    assert peak_mb() - before < 20


@pytest.mark.parametrize("template", [
    f'{{{{ "%{BIG}s" % "x" }}}}', f'{{{{ "%*s" % ({BIG}, "x") }}}}', f'{{{{ "x".ljust({BIG}) }}}}',
    f'{{{{ "x".rjust({BIG}) }}}}', f'{{{{ "x".zfill({BIG}) }}}}', f'{{{{ "x".center({BIG}) }}}}',
    f'{{{{ "\\t".expandtabs({BIG}) }}}}', f'{{{{ "{{:>{BIG}}}".format(1) }}}}', '{{ "{:{w}}".format(1, w=9) }}',
    '{{ range(100000)|join("x" * 100000) }}', '{{ ("x" * 50000).join(range(100000)) }}',
    '{{ ("x" * 100000)|replace("", "yy") }}', '{{ ("x" * 100000).replace("x", "yyy") }}',
    '{{ ("\\n" * 100000)|indent("x" * 100000) }}', '{{ ([[1] * 100000] * 100000)|sum(start=[]) }}',
    f'{{{{ "x" * {BIG} }}}}', f'{{{{ prompt|center({BIG}) }}}}',
])
def test_width_operations_are_refused_when_rendered(template):
    before = peak_mb()
    with pytest.raises((SecurityError, ValueError), match="not allowed|may not"):
        compile_bounded(template).render(prompt="p")
    assert peak_mb() - before < 50


def test_lipsum_is_not_available():
    with pytest.raises(UndefinedError):
        compile_bounded("{{ lipsum(100000000) }}").render()


@pytest.mark.parametrize("template,expected", [
    ("{{ prompt|center(7) }}", "  p=1  "), ('{{ "%5.2f"|format(3.14159) }}', " 3.14"), ('{{ "%s=%d" % ("a", 3) }}', "a=3"),
    ('{{ "{:>4}".format(prompt) }}', " p=1"), ('{{ [1, 2]|join(", ") }}', "1, 2"), ('{{ prompt|replace("=", ": ") }}', "p: 1"),
    ("{{ prompt|indent(2, true) }}", "  p=1"), ("{{ [[1], [2]]|sum(start=[]) }}", "[1, 2]"), ("{{ prompt.ljust(5) }}|", "p=1  |"),
    ('{{ [1, 2, 3]|batch(2)|list }}', "[[1, 2], [3]]"), ("{{ {'a': 1}|tojson(2) }}", '{\n  "a": 1\n}'),
    ("{{ '-' * 3 }}", "---"), ("{{ 2 ** 10 }}", "1024"),
])
def test_ordinary_templates_still_render(template, expected):
    assert compile_bounded(template).render(prompt="p=1") == expected


def test_compile_template_compiles_nothing_in_this_process(monkeypatch):
    import jinja2

    checked, compiled_here = [], []
    monkeypatch.setattr(prompts, "_template_checker", checked.append)
    monkeypatch.setattr(jinja2.Environment, "from_string", lambda *a, **k: compiled_here.append(a))
    deferred = compile_template('{{ "x"|center(100000000) }}')
    assert checked == ['{{ "x"|center(100000000) }}'] and compiled_here == []
    with pytest.raises(ValueError, match="would build more than 100000"):
        deferred.render()  # rendered in the bounded child, which refuses it
    assert compiled_here == []
