"""A GitHub Actions expression evaluator (``${{ }}`` and ``if:``), for the subset the workflows use:
literals, the github/inputs/vars/env contexts, ``==``, ``!=``, ``!``, ``&&``, ``||``, parentheses,
the status functions and ``format``. Syntax outside it is refused, never guessed
(``ExpressionError``)."""

from __future__ import annotations

import math
import re


class ExpressionError(ValueError):
    """Syntax the evaluator does not understand: it refuses rather than guesses."""


TOKEN = re.compile(r"\s*(?:(?P<op>==|!=|&&|\|\||!|\(|\)|,)|'(?P<str>(?:[^']|'')*)'"
                   r"|(?P<num>-?\d+(?:\.\d+)?)\b|(?P<name>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*))")
STATUS_FUNCTIONS = {"always", "cancelled", "success", "failure"}
CONTEXTS = {"github", "inputs", "vars", "env"}


def tokenize(text: str) -> list[tuple[str, object]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = TOKEN.match(text, pos)
        if not m:
            raise ExpressionError(f"cannot read {text[pos:]!r} in {text!r}")
        kind = m.lastgroup
        value = m.group(kind)
        tokens.append((kind, value.replace("''", "'") if kind == "str" else value))
        pos = m.end()
    return tokens


def parse(text: str) -> tuple:
    """The expression as a tree: ('or'|'and', a, b), ('not', a), ('==' | '!=', a, b),
    ('lit', value), ('path', [names]), ('call', name, [args])."""
    tokens, pos = tokenize(text), 0

    def peek() -> tuple[str, object] | None:
        return tokens[pos] if pos < len(tokens) else None

    def take(op: str | None = None) -> tuple[str, object]:
        nonlocal pos
        tok = peek()
        if tok is None or (op is not None and tok != ("op", op)):
            raise ExpressionError(f"expected {op or 'more'} at token {pos} of {text!r}")
        pos += 1
        return tok

    def binary(kind: str, sub, ops: tuple[str, ...]):
        def rule():
            node = sub()
            while peek() in [("op", o) for o in ops]:
                op = take()[1]
                node = (op if kind == "cmp" else kind, node, sub())
            return node
        return rule

    def unary():
        if peek() == ("op", "!"):
            take()
            return ("not", unary())
        return primary()

    def primary():
        kind, value = take()
        if (kind, value) == ("op", "("):
            node = disjunction()
            take(")")
            return node
        if kind == "str":
            return ("lit", value)
        if kind == "num":
            return ("lit", float(value))
        if kind == "name" and value in ("true", "false", "null"):
            return ("lit", {"true": True, "false": False, "null": None}[value])
        if kind == "name" and peek() == ("op", "("):
            if value not in STATUS_FUNCTIONS | {"format"}:
                raise ExpressionError(f"function {value}() is not supported (in {text!r})")
            take("(")
            args = [] if peek() == ("op", ")") else [disjunction()]
            while peek() == ("op", ","):
                take(",")
                args.append(disjunction())
            take(")")
            return ("call", value, args)
        if kind == "name":
            names = value.split(".")
            if names[0] not in CONTEXTS:
                raise ExpressionError(f"context {names[0]!r} is not simulated (in {text!r})")
            return ("path", names)
        raise ExpressionError(f"unexpected {value!r} in {text!r}")

    comparison = binary("cmp", unary, ("==", "!="))
    conjunction = binary("and", comparison, ("&&",))
    disjunction = binary("or", conjunction, ("||",))
    tree = disjunction()
    if peek() is not None:
        raise ExpressionError(f"unexpected {peek()[1]!r} in {text!r}")
    return tree


def truthy(v: object) -> bool:
    return not (v is None or v is False or v == "" or (isinstance(v, float) and (v == 0 or math.isnan(v))))


def _number(v: object) -> float:
    if v is None:
        return 0.0
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, float):
        return v
    if isinstance(v, str):
        try:
            return float(v.strip()) if v.strip() else 0.0
        except ValueError:
            return math.nan
    return math.nan


def equal(a: object, b: object) -> bool:
    """GitHub's ==: strings compare ignoring case; unlike types compare as numbers."""
    if isinstance(a, str) and isinstance(b, str):
        return a.casefold() == b.casefold()
    if type(a) is type(b) and not isinstance(a, float):
        return a is b if isinstance(a, (dict, list)) else a == b
    return _number(a) == _number(b)


def _lookup(obj: object, name: str) -> object:
    if not isinstance(obj, dict):
        return None
    if name in obj:
        return obj[name]
    return next((v for k, v in obj.items() if k.casefold() == name.casefold()), None)


def evaluate(node: tuple, ctx: dict, status: dict[str, bool]) -> object:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "path":
        value: object = ctx
        for name in node[1]:
            value = _lookup(value, name)
        return value
    if kind == "not":
        return not truthy(evaluate(node[1], ctx, status))
    if kind == "and":
        left = evaluate(node[1], ctx, status)
        return evaluate(node[2], ctx, status) if truthy(left) else left
    if kind == "or":
        left = evaluate(node[1], ctx, status)
        return left if truthy(left) else evaluate(node[2], ctx, status)
    if kind in ("==", "!="):
        same = equal(evaluate(node[1], ctx, status), evaluate(node[2], ctx, status))
        return same if kind == "==" else not same
    name, args = node[1], [evaluate(a, ctx, status) for a in node[2]]
    if name == "format":
        return re.sub(r"\{(\d+)\}", lambda m: _text(args[1 + int(m.group(1))]), _text(args[0]))
    if args or name not in status:
        raise ExpressionError(f"{name}() takes no arguments and is only known in a job's `if:`")
    return status[name]


def _text(v: object) -> str:
    """A value as GitHub renders it into a string."""
    if v is None or isinstance(v, bool):
        return {None: "", True: "true", False: "false"}[v]
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _uses_status_function(node: tuple) -> bool:
    if node[0] == "call":
        return node[1] in STATUS_FUNCTIONS or any(_uses_status_function(a) for a in node[2])
    return any(_uses_status_function(n) for n in node[1:] if isinstance(n, tuple))


def condition(value: object) -> tuple:
    """A job's `if:` as a tree; GitHub adds `success() &&` where no status function is used."""
    if value is None:
        return ("call", "success", [])
    if isinstance(value, bool):
        return ("lit", value)
    text = str(value).strip()
    if text.startswith("${{") and text.endswith("}}") and text.count("${{") == 1:
        text = text[3:-2]
    elif "${{" in text:
        raise ExpressionError(f"an `if:` mixing text and ${{{{ }}}}: {value!r}")
    tree = parse(text)
    return tree if _uses_status_function(tree) else ("and", ("call", "success", []), tree)


def interpolate(text: str, ctx: dict) -> str:
    """A string with ${{ }} parts, as GitHub renders it (status functions are not allowed there)."""
    return re.sub(r"\$\{\{(.*?)\}\}", lambda m: _text(evaluate(parse(m.group(1)), ctx, {})), text, flags=re.S)
