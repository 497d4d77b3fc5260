"""How a pydantic refusal reads in one line, at every boundary that validates untrusted input."""

from __future__ import annotations

from pydantic import ValidationError


def first_problem(error: ValidationError) -> tuple[str, str]:
    """The first field at fault, dotted ("" for the whole value), and what is wrong with it.

    One problem is enough for the sender to fix, and a message that lists them all can grow with
    the input it refuses."""
    if not error.error_count():
        return "", "unreadable"
    first = error.errors()[0]
    what = first["msg"]
    if first["type"] == "value_error" and "error" in first.get("ctx", {}):  # a validator's own words
        what = str(first["ctx"]["error"])
    return ".".join(str(part) for part in first["loc"]), what


def one_line(error: ValidationError) -> str:
    """`where: what`, or `what` alone when the whole value is at fault."""
    where, what = first_problem(error)
    return f"{where}: {what}" if where else what
