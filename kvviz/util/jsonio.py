"""JSON from files users hand in (workloads, capture lines, trace manifests), parsed so that any bad
input becomes one sentence naming the file and place, never a traceback: malformed text, another
encoding, nesting deep enough to exhaust Python's recursion, numbers too long to convert."""

from __future__ import annotations

import json

from ..errors import KvvizError


def parse_json(text: str | bytes, where: str, error: type[KvvizError], one_line: bool = False) -> object:
    """json.loads, with every failure raised as `error` starting with `where` (a file, or a line of one:
    `one_line`, and the place is a column)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        place = f"column {e.colno}" if one_line else f"line {e.lineno}, column {e.colno}"
        raise error(f"{where}: not valid JSON ({place}: {e.msg})") from None
    except UnicodeDecodeError:
        raise error(f"{where}: not UTF-8 text") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # json.loads raises this for numbers past int's digit limit
        raise error(f"{where}: {e}") from None
