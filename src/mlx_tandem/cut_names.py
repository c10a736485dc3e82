"""Tool calls whose names a format's parser cut short.

mlx-lm's (0.32) parsers read a name up to a character they do not expect: Mistral's
``get.weather[ARGS]`` came back as a call of a listed ``weather``, GLM's
``<tool_call>get weather</tool_call>`` as ``get``, Gemma 4's ``call:recall:get{`` as
``get``, LFM2's ``first-name=`` as a listed parameter ``name``, Qwen3.5's
``<function=get weather>`` as ``get`` (``xml_call_reading.reread_names`` reads those right). The
wrong tool ran, or a value went to another parameter. A call whose name (or an argument's)
its text writes only inside a longer listed one is refused here, so that it comes back as
an invalid call for the agent to show the model; a name written anywhere on its own (a
call of ``get`` beside one of ``get weather``, or whose value mentions ``get weather``) is
not doubted.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence


def check_not_cut_short(text: str, name: str, arguments: dict, tools: Optional[Sequence[dict]]) -> None:
    """Raise ValueError if ``text`` (the call's block, as the model wrote it) writes the
    call's ``name`` only inside a longer listed tool name, or an argument only inside a
    longer parameter name of that tool."""
    if not text or not tools:
        return
    functions = [t.get("function", {}) for t in tools]
    if _only_inside(text, name, [f.get("name") for f in functions]):
        raise ValueError(f"the call was read as one of {name!r}, which its text writes only as part of "
                         "a longer tool name (the format's parser cut the name short)")
    tool = next((f for f in functions if f.get("name") == name), {})
    props = (tool.get("parameters") or {}).get("properties") or {}
    for key in arguments:
        if _only_inside(text, key, props):
            raise ValueError(f"the argument {key!r} is written only as part of a longer parameter name "
                             "(the format's parser cut the name short)")


def _only_inside(text: str, part: Any, wholes: Any) -> bool:
    """Does ``text`` write ``part`` only inside one of the longer ``wholes`` that hold it?
    (Each place ``part`` is written is checked against the few places it sits in a longer
    name: linear in the text, where matching every pair of places was quadratic, seconds on
    an argument of 100K characters that repeats a longer key.)"""
    if not isinstance(part, str) or not part:
        return False
    inside = [(w, k) for w in wholes if isinstance(w, str) and len(w) > len(part)
              for k in range(len(w) - len(part) + 1) if w.startswith(part, k)]
    if not inside:
        return False
    written = False
    for m in re.finditer(f"(?={re.escape(part)})", text):
        i = m.start()
        if not any(i >= k and text.startswith(w, i - k) for w, k in inside):
            return False
        written = True
    return written
