"""Integer expressions in the token count, as a kernel plan writes grids, buffer sizes and scalar args.

A plan must stay plain data (JSON), yet its grids and sizes are functions of the run-time token count
``T``. They are written as small Python-syntax expressions (``"cdiv(T * 4, 16) + min(32, T * 4)"``)
over integer literals, the names a plan defines and the functions ``cdiv``, ``min`` and ``max``. This
module parses them with :mod:`ast` and evaluates only that subset: no attribute access, no calls to
anything else, no floats, so a plan read from a file cannot run code.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Mapping, Union

Expr = Union[int, str]

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}


class ExprError(ValueError):
    """A plan expression is malformed or names something undefined."""


@lru_cache(maxsize=1024)
def _parse(text: str) -> ast.expr:
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"bad plan expression {text!r}: {e.msg}") from None
    _check(tree, text)
    return tree


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, int) or isinstance(node.value, bool):
            raise ExprError(f"plan expression {text!r}: only integer literals are allowed")
    elif isinstance(node, ast.Name):
        pass
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise ExprError(f"plan expression {text!r}: operator {type(node.op).__name__} is not allowed")
        _check(node.left, text)
        _check(node.right, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check(node.operand, text)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS or node.keywords:
            raise ExprError(f"plan expression {text!r}: only {', '.join(_FUNCS)} may be called")
        for a in node.args:
            _check(a, text)
    else:
        raise ExprError(f"plan expression {text!r}: {type(node).__name__} is not allowed")


def _eval(node: ast.expr, env: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"plan expression {text!r}: unknown name '{node.id}' (known: {', '.join(env)})")
        return int(env[node.id])
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env, text), _eval(node.right, env, text))
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, env, text)
    return _FUNCS[node.func.id](*(_eval(a, env, text) for a in node.args))


def evaluate(expr: Expr, env: Mapping[str, int]) -> int:
    """Value of ``expr`` (an int, or an expression string) with the names in ``env`` bound."""
    if isinstance(expr, bool):
        raise ExprError(f"plan expression {expr!r}: expected an int or a string")
    if isinstance(expr, int):
        return expr
    if not isinstance(expr, str):
        raise ExprError(f"plan expression {expr!r}: expected an int or a string")
    return _eval(_parse(expr), env, expr)


def names(expr: Expr) -> set[str]:
    """Names an expression refers to (for validating a plan without evaluating it)."""
    if isinstance(expr, int):
        return set()
    return {n.id for n in ast.walk(_parse(expr)) if isinstance(n, ast.Name)} - set(_FUNCS)
