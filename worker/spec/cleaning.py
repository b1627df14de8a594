"""Text and numbers a job wrote, made fit for every reader and column: the one cleaner of text
(clean_text), of parsed JSON (storable, json_problem) and of whole numbers (ascii_int)."""

from __future__ import annotations

import math
import re
from typing import Any

MAX_JSON_DEPTH = 32  # nesting of any JSON value the service stores (kwargs, results, progress)
_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: valid JSON text, not UTF-8

MAX_DIGITS = 18  # any count or id a job folder or a scheduler names fits; int() refuses 4,300 and more


def ascii_int(text: str) -> int | None:
    """`text` as a whole number when it is 1 to MAX_DIGITS ASCII digits, else None.

    The one way a number written by a job (a file name, a line of a file) or printed by a command is
    read: str.isdigit() also accepts "²" and other digits that int() then refuses, and a long run of
    digits makes int() raise too, either of which would stop a loop that reads many jobs' files."""
    if 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit():
        return int(text)
    return None


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """Where `value` (parsed JSON) is not something every reader can be served, and why: (the path to
    it, dotted, "" for the value itself; the problem). None when it is fine.

    A lone surrogate ("\\ud800") or a NaN parses, and a row holding one then fails every response
    it is in; NUL cannot be stored by PostgreSQL; deep nesting costs recursion in every reader.
    Iterative, so that no depth of input can exhaust the stack here.
    """
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, str):
            if held := unservable_text(item):
                return path, f"must not hold {held}"
        elif isinstance(item, float) and not math.isfinite(item):
            return path, "must be a finite number (NaN and Infinity are not JSON)"
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                return path, f"nests deeper than {max_depth} levels"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                child_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and (held := unservable_text(key)):
                    return clean_text(child_path), f"its name must not hold {held}"
                stack.append((child_path, child, depth + 1))
    return None


def storable(value: Any, depth: int = 0) -> Any:
    """`value` (parsed JSON a job wrote) made servable: NaN and infinities become None, lone
    surrogates U+FFFD, NUL is dropped, and what nests deeper than MAX_JSON_DEPTH becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict | list):
        if depth >= MAX_JSON_DEPTH:
            return None
        if isinstance(value, dict):
            return {clean_text(str(key)): storable(item, depth + 1) for key, item in value.items()}
        return [storable(item, depth + 1) for item in value]
    return value


def clean_text(text: str, most: int | None = None) -> str:
    """`text` as every reader and column can hold it: lone surrogates become U+FFFD, NUL is dropped,
    and what is past its first `most` characters (when given) is cut. The one cleaner of text a job
    wrote (tracebacks, log tails, JSON values) before it goes near the ledger."""
    cleaned = _SURROGATE.sub("\ufffd", text).replace("\x00", "")
    return cleaned if most is None else cleaned[:most]


def unservable_text(text: str) -> str | None:
    """What in `text` no response or PostgreSQL column can hold, or None."""
    if _SURROGATE.search(text):
        return "a lone UTF-16 surrogate (it is not UTF-8)"
    if "\x00" in text:
        return "a NUL character"
    return None
