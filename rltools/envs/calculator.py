"""The calculator tool: `<calc>37*48</calc>` -> `<result>1776</result>`, our own minimal format for a
char-level model (the tool demo's model was pretrained on exactly these strings).

Invariant: `evaluate` never runs the model's text as code (it walks the `ast` of an expression made
only of digits, operators and parentheses) and never takes long: every number, intermediate ones
included, stays within MAX_DIGITS digits, and a power is refused before it is computed if it could not.
"""

import ast
import re
from fractions import Fraction

OPEN, CLOSE = "<calc>", "</calc>"
ERROR = "error"
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 30
"""Numerators and denominators stay below 10**MAX_DIGITS; beyond is an error ("too large")."""
DECIMALS = 6
"""A non-integer result is printed rounded to this many decimals, trailing zeros dropped."""
ALLOWED_CHARS = re.compile(r"[0-9+\-*/%() \t]*")
BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: Fraction(a // b),
          ast.Mod: lambda a, b: a % b}


class CalcError(ValueError):
    """The expression is not one the calculator evaluates: syntax, division by zero, too large."""


def answer(expression: str) -> tuple[str, bool]:
    """(the `<result>` text, whether it is an error) for the text between `<calc>` and `</calc>`."""
    try:
        return f"<result>{evaluate(expression)}</result>", False
    except CalcError:
        return f"<result>{ERROR}</result>", True


def evaluate(expression: str) -> str:
    """The value of an integer-arithmetic expression, printed canonically.

    + - * / // % ** and parentheses over non-negative integer literals (unary - and + too). `/` is
    exact division: 84/2 -> 42, 7/2 -> 3.5, 2/3 -> 0.666667 (rounded to DECIMALS). `//` and `%` floor,
    as in Python. Raises CalcError for anything else.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    if not ALLOWED_CHARS.fullmatch(expression):
        raise CalcError("only digits, + - * / % ( ) and spaces")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise CalcError(f"not an expression: {err}") from None
    return _format(_value(tree.body))


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_value(node.left), _value(node.right)))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _value(node.left), _value(node.right)
        try:
            return _checked(BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
    raise CalcError(f"unsupported: {type(node).__name__}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalcError("a non-integer exponent")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    # A base other than 0 and +-1 gains at least a bit per step: bound the result before computing it.
    largest = max(abs(base.numerator), base.denominator)
    if largest > 1 and (largest.bit_length() - 1) * abs(exponent) > MAX_DIGITS * 3.33:
        raise CalcError("too large")
    return base ** int(exponent)


def _checked(value: Fraction) -> Fraction:
    limit = 10**MAX_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise CalcError("too large")
    return value


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, DECIMALS)
    sign = "-" if rounded < 0 else ""
    whole, fraction = divmod(abs(rounded) * 10**DECIMALS, 10**DECIMALS)
    digits = f"{int(fraction):0{DECIMALS}d}".rstrip("0")
    return f"{sign}{int(whole)}.{digits}" if digits else f"{sign}{int(whole)}"
