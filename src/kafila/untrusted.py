"""Text that came from the network, made safe to show: names, error texts, frame contents and the
rendezvous's messages are hostile until shown otherwise. Printed as they came, an escape sequence
would reach the person's terminal (clear the screen, write the clipboard) and a bracket would be
read as rich markup (which can raise, and end whatever was printing).

Pure: `printable` drops what a terminal would act on; `check_name` is the rule for a device's name
wherever one is accepted; the console shells (`kafila.cli`) escape markup on top.
"""

from __future__ import annotations

import unicodedata

MAX_SHOWN_CHARS = 2000  # past this, a message from the network is cut: it is shown, not stored
MAX_NAME_CHARS = 80
# Unicode's control (Cc), format (Cf: bidirectional overrides, zero-width), surrogate, private-use
# and unassigned categories: nothing a name needs, and what a terminal or a reader can be fooled by.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})


def printable(text: str, limit: int = MAX_SHOWN_CHARS, newlines: bool = False) -> str:
    """`text` without control or format characters (each becomes U+FFFD; a tab, a space; a newline
    stays where `newlines`), cut to `limit` characters with an ellipsis."""
    kept = []
    for char in text[: limit + 1]:
        if char == "\n" and newlines:
            kept.append(char)
        elif char == "\t":
            kept.append(" ")
        elif unicodedata.category(char) in _HIDDEN:
            kept.append("\N{REPLACEMENT CHARACTER}")
        else:
            kept.append(char)
    shown = "".join(kept)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def check_name(name: str) -> str:
    """A device's name as a session accepts it: 1 to 80 characters, none of them a control or
    format character, and not blank. ValueError says what is wrong."""
    if not name.strip():
        raise ValueError("a name must not be empty or blank")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a name has at most {MAX_NAME_CHARS} characters")
    if name != name.strip():
        raise ValueError("a name must not begin or end with a space")
    for char in name:
        if char != " " and (unicodedata.category(char) in _HIDDEN or unicodedata.category(char).startswith("Z")):
            raise ValueError(f"a name may hold printable characters only, not {char!a}")
    return name
