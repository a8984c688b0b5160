"""Generate docs/api.md, the API reference, from the public names' signatures and docstrings.

    python docs/render_api.py          # rewrite docs/api.md
    python docs/render_api.py --check  # change nothing; exit 1, with a diff, if docs/api.md is out of date

What it documents: every name in ``zeroimpl.__all__``, every name in ``zeroimpl.checkpoint.__all__``,
``zeroimpl.integrations.trainer.ZeroTrainer``, the Lightning strategies and accelerate's ``prepare``, in that order, as the code defines them now: signatures from
``inspect.signature``, text from the docstrings (Google-style ``Args:`` sections become tables of name,
default and meaning; dataclass fields a table of name, type, default and the field's attribute docstring),
and the public methods and properties that zeroimpl's own classes define. Nothing names a module file, so
moving an object between modules changes nothing here; changing a signature or a docstring does, and
``tests/test_docs.py`` fails until this script is re-run.
"""

from __future__ import annotations

import abc
import argparse
import ast
import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "docs", "api.md")
SCRIPT = "docs/render_api.py"
UNDOCUMENTED = "**not in the docstring's Args section**"
NOT_A_PARAMETER = "**in the docstring's Args section, but not a parameter**"
WIDTH = 100  # signatures longer than this are written one parameter a line
ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters)\b[^:]*:$")
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


# -- the public names --------------------------------------------------------------------------------
def sections() -> list[tuple[str, str, list[tuple[str, object]]]]:
    """(heading, intro, [(public dotted name, object)]) for each part of the page."""
    if ROOT not in sys.path:
        sys.path.append(ROOT)  # after PYTHONPATH and the installed package
    zeroimpl = importlib.import_module("zeroimpl")
    checkpoint = importlib.import_module("zeroimpl.checkpoint")
    trainer = importlib.import_module("zeroimpl.integrations.trainer")
    lightning = importlib.import_module("zeroimpl.integrations.lightning")
    accelerate = importlib.import_module("zeroimpl.integrations.accelerate")
    return [
        ("zeroimpl", first_paragraph(zeroimpl.__doc__),
         [(f"zeroimpl.{name}", getattr(zeroimpl, name)) for name in zeroimpl.__all__]),
        ("zeroimpl.checkpoint", first_paragraph(checkpoint.__doc__) + " Format, resharding, crash safety and the "
         "`python -m zeroimpl.checkpoint` command: [checkpoints.md](checkpoints.md).",
         [(f"zeroimpl.checkpoint.{name}", getattr(checkpoint, name)) for name in checkpoint.__all__]),
        ("zeroimpl.integrations.trainer", first_paragraph(trainer.__doc__) + " What it relies on in Trainer: "
         "[trainer.md](trainer.md).",
         [("zeroimpl.integrations.trainer.ZeroTrainer", trainer.ZeroTrainer)]),
        ("zeroimpl.integrations.lightning", first_paragraph(lightning.__doc__) + " What they rely on in Lightning: "
         "[lightning.md](lightning.md).",
         [(f"zeroimpl.integrations.lightning.{name}", getattr(lightning, name))
          for name in ("ZeroStrategy", "FabricZeroStrategy")]),
        ("zeroimpl.integrations.accelerate", first_paragraph(accelerate.__doc__) + " More: [accelerate.md](accelerate.md).",
         [("zeroimpl.integrations.accelerate.prepare", accelerate.prepare)]),
    ]


# -- docstrings to Markdown --------------------------------------------------------------------------
def inline(text: str) -> str:
    """reST inline markup to Markdown: roles and ``literals`` become `code`."""
    text = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return re.sub(r"``(.+?)``", lambda m: "`" + " ".join(m.group(1).split()) + "`", text, flags=re.S)


def first_paragraph(doc) -> str:
    return inline(" ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split()))


def split_args(doc: str) -> tuple[str, list[tuple[str, str]], str]:
    """A cleaned docstring -> (text before the Args section, [(name, description)], text after it)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if ARGS_HEADER.match(line)), None)
    if start is None:
        return doc, [], ""
    entries: list[list[str]] = []
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        line = lines[end]
        match = re.match(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?: ?(.*)$", line)
        if match:
            entries.append([match.group(1), match.group(2)])
        elif line.strip() and entries:
            entries[-1][1] += " " + line.strip()
        end += 1
    return ("\n".join(lines[:start]).strip(), [(name, " ".join(text.split())) for name, text in entries],
            "\n".join(lines[end:]).strip())


def prose(doc: str) -> str:
    """Docstring prose to Markdown: paragraphs and bullet lists kept, ``::`` literal blocks fenced."""
    segments: list[tuple[bool, list[str]]] = [(False, [])]  # (is code, lines)
    lines, i = doc.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.rstrip().endswith("::"):
            segments[-1][1].append(line)
            continue
        segments[-1][1].append(line.rstrip()[:-1].rstrip() + ":" if line.strip() != "::" else "")
        block = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            block.append(lines[i])
            i += 1
        segments += [(True, ["", "```text", *textwrap.dedent("\n".join(block)).strip("\n").splitlines(), "```", ""]),
                     (False, [])]
    text = "\n".join("\n".join(chunk) if code else inline("\n".join(chunk)) for code, chunk in segments)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


# -- signatures --------------------------------------------------------------------------------------
def annotation(value) -> str:
    if isinstance(value, str):  # postponed evaluation: the source text, a forward reference's quotes dropped
        return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
    return inspect.formatannotation(value)


def value_repr(value) -> str:
    if isinstance(value, type):
        return value.__name__ if value.__module__ == "builtins" else f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def parameter(p: inspect.Parameter) -> str:
    text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    if p.annotation is not p.empty:
        text += f": {annotation(p.annotation)}"
    if p.default is not p.empty:
        text += f" = {value_repr(p.default)}" if p.annotation is not p.empty else f"={value_repr(p.default)}"
    return text


def signature_text(name: str, signature: inspect.Signature) -> str:
    parts, star_done, positional_only = [], False, False
    for p in signature.parameters.values():
        if positional_only and p.kind is not p.POSITIONAL_ONLY:
            parts.append("/")
            positional_only = False
        if p.kind is p.POSITIONAL_ONLY:
            positional_only = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        parts.append(parameter(p))
    if positional_only:
        parts.append("/")
    returns = "" if signature.return_annotation is signature.empty else \
        f" -> {annotation(signature.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def own_signature(obj):
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return signature


def without_self(signature: inspect.Signature, first: str = "self") -> inspect.Signature:
    params = list(signature.parameters.values())
    return signature.replace(parameters=params[1:]) if params and params[0].name == first else signature


# -- classes ------------------------------------------------------------------------------------------
def is_zeroimpl(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "zeroimpl"


def qualified(cls: type, public: dict[int, str]) -> str:
    if id(cls) in public:
        return public[id(cls)]
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def public_bases(cls: type, public: dict[int, str]) -> list[type]:
    """Direct bases, with zeroimpl's private classes (mixins, helpers) replaced by their own public bases."""
    bases: list[type] = []
    for base in cls.__bases__:
        if base in (object, abc.ABC):
            continue
        for found in ([base] if id(base) in public or not is_zeroimpl(base) else public_bases(base, public)):
            if found not in bases:
                bases.append(found)
    return bases


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (a string right after the field) of a dataclass's fields, by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def fields_table(cls: type) -> str:
    docs = field_docs(cls)
    rows = []
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            default = f"`{value_repr(field.default)}`"
        elif field.default_factory is not dataclasses.MISSING:
            default = f"`{value_repr(field.default_factory)}()`"
        else:
            default = "required"
        row = [f"`{field.name}`", f"`{annotation(field.type)}`", default]
        rows.append(row + [inline(docs.get(field.name, ""))] if docs else row)
    return table(["field", "type", "default"] + (["meaning"] if docs else []), rows)


def options_table(signature: inspect.Signature, entries: list[tuple[str, str]]) -> str:
    """The constructor's parameters, in signature order, with the default and the docstring's description."""
    described = {name.lstrip("*"): text for name, text in entries}
    rows = []
    for p in signature.parameters.values():
        variadic = p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if variadic and p.name not in described:
            continue  # *args / **kwargs handed on to a base class: the signature shows them
        name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        default = "" if variadic else "required" if p.default is p.empty else f"`{value_repr(p.default)}`"
        rows.append([f"`{name}`", default, inline(described.pop(p.name, UNDOCUMENTED))])
    rows += [[f"`{name}`", "", NOT_A_PARAMETER] for name in described]
    return table(["option", "default", "meaning"], rows)


def members(cls: type, public: dict[int, str]) -> tuple[list[str], list[str]]:
    """Markdown for each public method and property that zeroimpl's classes in ``cls``'s MRO define, and the
    sentence naming those that override a base class's without a docstring of their own."""
    found: dict[str, tuple[type, object]] = {}
    for klass in cls.__mro__:
        if not is_zeroimpl(klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in found:
                continue
            if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
                found[name] = (klass, value)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    documented, bare = [], []
    for name in sorted(found):
        if name in fields:
            continue
        _, value = found[name]
        function = value.fget if isinstance(value, property) else \
            value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not function.__doc__:
            origin = next((k for k in cls.__mro__ if not is_zeroimpl(k) and name in vars(k)), None)
            bare.append(f"`{name}`" + (f" (overrides `{qualified(origin, public)}.{name}`)" if origin else ""))
            continue
        if isinstance(value, property):
            signature = own_signature(function)
            returns = "" if signature is None or signature.return_annotation is signature.empty else \
                f": {annotation(signature.return_annotation)}"
            code = f"{name}{returns}  # property"
        else:
            signature = own_signature(function)
            if signature is not None and not isinstance(value, staticmethod):
                signature = without_self(signature, "cls" if isinstance(value, classmethod) else "self")
            code = signature_text(name, signature) if signature else name
            if isinstance(value, (staticmethod, classmethod)):
                code += f"  # {type(value).__name__}"
        documented.append(f"#### {name}\n\n```python\n{code}\n```\n\n{prose(inspect.cleandoc(function.__doc__))}")
    return documented, bare


# -- the page -----------------------------------------------------------------------------------------
def document(public_name: str, obj, public: dict[int, str]) -> str:
    short = public_name.rsplit(".", 1)[-1]
    doc = inspect.cleandoc(obj.__doc__ or "")
    parts = [f"### {short}"]
    if inspect.isclass(obj):
        bases = public_bases(obj, public)
        signature = own_signature(obj) if not issubclass(obj, BaseException) else None
        if signature is not None:  # a constructor: `-> None` says nothing
            signature = signature.replace(return_annotation=inspect.Signature.empty)
        if signature is not None:
            parts.append(f"```python\n{signature_text(public_name, signature)}\n```")
        kind = "Exception" if issubclass(obj, BaseException) else "Dataclass" if dataclasses.is_dataclass(obj) \
            else "Class"
        parts.append(f"{kind}" + (f"; subclass of {', '.join(f'`{qualified(b, public)}`' for b in bases)}."
                                  if bases else "."))
        before, entries, after = split_args(doc)
        if entries and signature is not None:
            parts += [prose(before), "Options:", options_table(signature, entries)] + ([prose(after)] if after else [])
        elif doc:
            parts.append(prose(doc))
        if dataclasses.is_dataclass(obj):
            parts += ["Fields:", fields_table(obj)]
        documented, bare = members(obj, public)
        if documented:
            parts += [f"Methods and properties of `{short}`:"] + documented
        if bare:
            parts.append(f"Also public, without a docstring of their own: {', '.join(bare)}.")
    else:
        signature = own_signature(obj)
        parts.append(f"```python\n{signature_text(public_name, signature) if signature else public_name}\n```")
        before, entries, after = split_args(doc)
        if entries and signature is not None:
            parts += [prose(before), "Arguments:", options_table(signature, entries)] + \
                     ([prose(after)] if after else [])
        else:
            parts.append(prose(doc))
        module = sys.modules.get(getattr(obj, "__module__", ""), None)
        if "module docstring" in doc and module is not None and module.__doc__:
            parts += ["The module docstring it refers to:", prose(inspect.cleandoc(module.__doc__))]
    return "\n\n".join(p for p in parts if p)


def render() -> str:
    parts_of = sections()
    public = {id(obj): name for _, _, objects in parts_of for name, obj in objects if inspect.isclass(obj)}
    out = ["# API reference",
           "Back to the [README](../README.md).",
           f"<!-- Generated by `python {SCRIPT}` from the signatures and docstrings; do not edit by hand "
           "(tests/test_docs.py checks it). -->",
           "Every public name, as the code defines it: the names `zeroimpl` exports (`zeroimpl.__all__`), the "
           "checkpoint functions (`zeroimpl.checkpoint.__all__`) and `ZeroTrainer`. How to use them: "
           "[usage.md](usage.md).",
           "## Contents"]
    contents = []
    for heading, _, objects in parts_of:
        contents.append(f"- `{heading}`: " + ", ".join(
            f"[{name.rsplit('.', 1)[-1]}](#{name.rsplit('.', 1)[-1].lower()})" for name, _ in objects))
    out.append("\n".join(contents))
    for heading, intro, objects in parts_of:
        out += [f"## {heading}", intro]
        out += [document(name, obj, public) for name, obj in objects]
    return "\n\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if docs/api.md is out of date")
    args = parser.parse_args()
    rendered = render()
    current = open(OUTPUT).read() if os.path.exists(OUTPUT) else ""
    if rendered == current:
        print("up to date")
        return 0
    if args.check:
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), rendered.splitlines(True), "docs/api.md",
                                                   "docs/api.md (rendered from the code)"))
        print(f"\ndocs/api.md is out of date; run python {SCRIPT}", file=sys.stderr)
        return 1
    with open(OUTPUT, "w") as handle:
        handle.write(rendered)
    print("rewrote docs/api.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
