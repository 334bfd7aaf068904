"""MkDocs hooks (mkdocs.yml `hooks:`): the pages with one source of truth elsewhere are
written at build time, never by hand.

- spec-reference.md, from the pydantic models of workers/spec/ (fields, types, defaults,
  bounds, descriptions, nested sections): a field added there appears here at the next build;
- api-reference.md, from the OpenAPI schema that drf-spectacular makes of the platform's
  views (`manage.py spectacular`, in a child process: Django is set up there, not here);
- the repository files the pages show (MIRRORED: a plot a bench writes), taken from where
  the bench writes them;
- the Guides section: every docs/guides/*.md is put in the navigation, with an index page
  listing them, so a new guide needs no edit of mkdocs.yml and a missing one breaks nothing."""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
import typing
from collections import Counter
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.fluxrl_docs")

SPEC_PAGE = "spec-reference.md"
API_PAGE = "api-reference.md"
GUIDES = "guides"
GUIDES_INDEX = f"{GUIDES}/index.md"
# Files of the repository the site shows as they are, never copied by hand (docs path -> repository path).
MIRRORED = {"assets/add_async.svg": "bench/results/add_async.svg"}


def generated_pages() -> set[str]:
    """What this hook adds to docs/ at build time (paths relative to docs/): links to them are good."""
    return {SPEC_PAGE, API_PAGE, GUIDES_INDEX, *MIRRORED}


# --- the Guides section ------------------------------------------------------------------


def guide_files(docs_dir: Path) -> list[Path]:
    return sorted(p for p in (docs_dir / GUIDES).glob("*.md") if p.name != "index.md")


def guide_title(path: Path) -> str:
    heading = re.search(r"^#\s+(.+?)\s*#*\s*$", path.read_text(encoding="utf-8"), re.M)
    return heading.group(1) if heading else path.stem.replace("-", " ").capitalize()


def guide_summary(path: Path) -> str:
    """The first paragraph after the title, on one line."""
    paragraphs = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    for paragraph in paragraphs:
        text = paragraph.strip()
        if text and not text.startswith(("#", "```", "|", "<", "!", "-", "*", ">")):
            text = " ".join(text.split())
            if text.endswith(":") and ". " in text:  # it leads into a list: its whole sentences only
                text = text[:text.rindex(". ") + 1]
            return text
    return ""


def on_config(config):
    """Append a Guides section to the navigation: its index, then every guide by title."""
    docs_dir = Path(config["docs_dir"])
    nav = config.get("nav")
    if nav is not None:
        entries = [{guide_title(p): f"{GUIDES}/{p.name}"} for p in guide_files(docs_dir)]
        nav[:] = [item for item in nav if not (isinstance(item, dict) and "Guides" in item)]
        nav.append({"Guides": [{"All guides": GUIDES_INDEX}, *entries]})
    return config


def guides_index(docs_dir: Path) -> str:
    lines = ["# Guides", "", "How to do one thing with FluxRL, a page each. This list is made from the "
             "files in `docs/guides/` when the site is built.", ""]
    guides = guide_files(docs_dir)
    for path in guides:
        summary = guide_summary(path)
        lines.append(f"- [{guide_title(path)}]({path.name})" + (f": {summary}" if summary else ""))
    if not guides:
        lines.append("No guides yet.")
    return "\n".join(lines) + "\n"


# --- the spec reference ----------------------------------------------------------------------


def _constraints(field) -> list[str]:
    words = []
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤",
               "pattern": "matches"}
    for item in field.metadata:
        for attribute, symbol in symbols.items():
            value = getattr(item, attribute, None)
            if value is not None:
                words.append(f"{symbol} `{value}`")
    return words


def _is_model(tp) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_name(tp, path: str, nested: dict) -> str:
    """A readable type; a nested model is recorded in `nested` (dotted path -> model) and linked."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type_name(args[0], path, nested)
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a, path, nested) for a in args)
    if origin in (list, tuple, set):
        return "list of " + (_type_name(args[0], path + "[]", nested) if args else "any")
    if origin is dict:
        return "mapping" + (f" of {_type_name(args[0], path, nested)} to {_type_name(args[1], path, nested)}"
                            if args else "")
    if _is_model(tp):
        nested[path] = tp
        return f"[{tp.__name__}](#{_anchor(path)})"
    if tp is typing.Any:
        return "any"
    return f"`{getattr(tp, '__name__', str(tp))}`"


def _anchor(path: str) -> str:
    return "spec-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _default(field) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if _is_model(type(value)):
        return "its fields' defaults"
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return _escape(" ".join(str(text).split()).replace("|", "\\|"))


def _docstring_markdown(doc: str) -> str:
    """A model's docstring as Markdown: paragraphs joined, `- ` lines kept as list items, and a
    paragraph after one ending in `::` (reStructuredText's literal block) as a code block."""
    out, literal = [], False
    for paragraph in re.split(r"\n\s*\n", doc.replace("``", "`")):
        if literal:
            out.append("```yaml\n" + textwrap.dedent(paragraph) + "\n```")
            literal = False
            continue
        items: list[str] = []
        for line in paragraph.splitlines():
            line = line.strip()
            if line.startswith("- ") or not items:
                items.append(line)
            else:
                items[-1] += " " + line
        text = _escape("\n".join(items))
        if text.endswith("::"):
            text, literal = text[:-1], True
        out.append(text)
    return "\n\n".join(out)


def _escape(text: str) -> str:
    """Angle brackets outside code spans as entities: `<pk>` must not read as an HTML tag."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;") for p in parts)


def _model_section(path: str, model, nested: dict) -> list[str]:
    title = path or "The run spec"
    lines = [f"## `{title}` {{#{_anchor(path or 'root')}}}" if path else f"## {title} {{#{_anchor('root')}}}", ""]
    doc = inspect.cleandoc(model.__doc__ or "")
    if doc and not doc.startswith(("A base class", "Usage docs")):
        lines += [_docstring_markdown(doc), ""]
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        type_text = _type_name(field.annotation, dotted, nested)
        lines.append(f"| `{dotted}` | {type_text} | {_cell(_default(field))} | {_cell(', '.join(_constraints(field)))} "
                     f"| {_cell(field.description or '')} |")
    return lines + [""]


def spec_reference() -> str:
    sys.path.insert(0, str(REPO))
    from workers import spec

    lines = [
        "# Spec reference",
        "",
        "Every field of a run spec, generated from the pydantic models of `workers/spec/` when this site "
        "is built (that package is the one validator the CLI, the REST API and the dashboard share). Unknown "
        "fields are errors that name the field; rules that tie fields together (for example "
        "`schedule.stream_train` needs `schedule.mode: sync`) are checked after the fields and refused with a "
        "message naming them. [Writing a spec](spec.md) explains the common choices.",
        "",
    ]
    nested: dict[str, type] = {}
    pending = [("", spec.RunSpec)]
    done = set()
    while pending:  # depth first: a nested section right after the section that holds it
        path, model = pending.pop(0)
        if path in done:
            continue
        done.add(path)
        before = set(nested)
        lines += _model_section(path, model, nested)
        pending[:0] = [(p, nested[p]) for p in nested if p not in before]
    return "\n".join(lines)


# --- the REST API reference ----------------------------------------------------------------


def openapi_schema() -> dict:
    """drf-spectacular's schema of the platform, made in a child process (Django set up there)."""
    with tempfile.TemporaryDirectory(prefix="fluxrl-docs-") as tmp:
        out = Path(tmp) / "openapi.json"
        env = {**os.environ, "FLUXRL_DATA_DIR": str(Path(tmp) / "data")}
        env.pop("DATABASE_URL", None)  # the schema reads views and serializers, never the database
        result = subprocess.run([sys.executable, str(REPO / "manage.py"), "spectacular", "--format", "openapi-json",
                                 "--file", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if result.returncode:
            raise RuntimeError(f"manage.py spectacular failed:\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())


SHARED_DESCRIPTION = 3


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _schema_type(schema: dict) -> str:
    if not schema:
        return "any"
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#schema-{name.lower()})"
    for key in ("allOf", "oneOf", "anyOf"):
        if key in schema:
            return " or ".join(_schema_type(s) for s in schema[key])
    kind = schema.get("type", "object")
    if kind == "array":
        return "list of " + _schema_type(schema.get("items", {}))
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"] if v is not None) or "enum"
    text = f"`{kind}`" if isinstance(kind, str) else " or ".join(f"`{k}`" for k in kind)
    text += f" ({schema['format']})" if "format" in schema else ""
    return text + (" or null" if schema.get("nullable") else "")


def _operation(method: str, path: str, op: dict, shared: set[str]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [_escape(op["summary"]), ""]
    if op.get("description") and op["description"] not in shared:
        lines += [_escape(" ".join(op["description"].split())), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} | "
                         f"{'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |")
        lines.append("")
    body = op.get("requestBody", {}).get("content", {})
    if body:
        kinds = ", ".join(f"`{ct}` {_schema_type(c.get('schema', {}))}" for ct, c in body.items())
        lines += [f"**Body:** {kinds}", ""]
    ok, errors = [], []
    for code, response in op.get("responses", {}).items():
        content = response.get("content", {})
        shape = next((_schema_type(c.get("schema", {})) for c in content.values()), "")
        (ok if code.startswith("2") else errors).append((code, shape, response.get("description", "")))
    for code, shape, description in ok:
        lines.append(f"**{code}:** {shape or _cell(description) or 'no body'}")
        lines.append("")
    if errors:
        lines += ["**Errors:** " + ", ".join(code for code, _, _ in errors) +
                  " (the [error body](#schema-error))", ""]
    return lines


def api_reference() -> str:
    schema = openapi_schema()
    info = schema.get("info", {})
    lines = [
        "# API reference",
        "",
        f"{info.get('title', 'FluxRL API')}, version {info.get('version', '')}: every operation and body, "
        "generated from the OpenAPI schema that drf-spectacular makes of the platform's views when this site is "
        "built. A running server serves the same schema at `/api/schema/` and a browsable form at `/api/docs/` "
        "(both for signed-in users). [REST API](api.md) is the overview with examples.",
        "",
        " ".join(info.get("description", "").split()),
        "",
    ]
    by_tag: dict[str, list] = {}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    # A description on many operations is a shared base view's docstring, not the operation's.
    counts = Counter(op.get("description") for ops in by_tag.values() for _, _, op in ops)
    shared = {text for text, n in counts.items() if text and n > SHARED_DESCRIPTION}
    for tag in sorted(by_tag):
        lines += [f"## {tag}", ""]
        for method, path, op in by_tag[tag]:
            lines += _operation(method, path, op, shared)
    lines += ["## Schemas", ""]
    for name, body in sorted(schema.get("components", {}).get("schemas", {}).items()):
        lines += [f"### {name} {{#schema-{name.lower()}}}", ""]
        if body.get("description"):
            lines += [_escape(" ".join(body["description"].split())), ""]
        properties = body.get("properties")
        if properties:
            required = set(body.get("required", []))
            lines += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, prop in properties.items():
                flags = ("yes" if field in required else "no") + (", read-only" if prop.get("readOnly") else "") + \
                    (", write-only" if prop.get("writeOnly") else "")
                lines.append(f"| `{field}` | {_schema_type(prop)} | {flags} | {_cell(prop.get('description', ''))} |")
            lines.append("")
        elif "enum" in body:
            lines += ["One of " + ", ".join(f"`{json.dumps(v)}`" for v in body["enum"] if v is not None) + ".", ""]
        else:
            lines += [f"Type {_schema_type(body)}.", ""]
    return "\n".join(lines)


# --- the generated files ---------------------------------------------------------------------


def on_files(files, config):
    docs_dir = Path(config["docs_dir"])
    pages = {SPEC_PAGE: spec_reference(), API_PAGE: api_reference(), GUIDES_INDEX: guides_index(docs_dir)}
    for name, content in pages.items():
        existing = files.get_file_from_path(name)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, name, content=content))
        log.debug("generated %s", name)
    for name, source in MIRRORED.items():
        files.append(File.generated(config, name, abs_src_path=str(REPO / source)))
    return files
