"""What every command shares: the one way a command refuses bad input, so scripts see the same
`kvviz: TOPIC: reason` line on stderr and exit status 2 whichever command they ran."""

from __future__ import annotations

import sys


def fail(reason: object, topic: str = "error") -> int:
    """Print the reason (no traceback) and return the exit status for bad input."""
    print(f"kvviz: {topic}: {reason}", file=sys.stderr)
    return 2
