"""Pythonic calls (Llama 3.2/4 and others): the whole answer is a Python list of calls with
keyword arguments of literal values, ``[get_weather(city="Paris"), noop()]``. An answer
that cannot begin such a list is content. A call is sent once its closing parenthesis is
written (its arguments are converted to JSON, so they cannot be streamed as written)."""

from __future__ import annotations

import ast
import json
import re

from fastsched.gateway.tool_parsers.base import Extraction, NotACall, PartialCall, require_complete

_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_START = re.compile(r"\s*(\[\s*([A-Za-z_][\w.]*\s*)?)?")


class PythonicParser:
    name = "pythonic"

    def extract(self, text: str, final: bool) -> Extraction:
        if _START.match(text) is None:
            if final:
                raise NotACall("the answer is not a list of calls")
            return Extraction("" if _MAYBE_START.fullmatch(text) else text)
        if final:
            return Extraction("", require_complete(_calls(text.strip()), final))
        for i in range(len(text) - 1, -1, -1):  # the longest prefix of whole calls
            if text[i] == ")":
                try:
                    return Extraction("", _calls(text[: i + 1].strip() + "]"))
                except NotACall:
                    continue
        return Extraction("")


def _calls(source: str) -> list[PartialCall]:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise NotACall("not a Python list") from e
    if not isinstance(tree, ast.List):
        raise NotACall("not a Python list")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise NotACall("a list element that is not a call with keyword arguments")
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError as e:
            raise NotACall("an argument that is not a literal") from e
        calls.append(PartialCall(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
    return calls
