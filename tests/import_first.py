"""Import each kvviz module given on the command line first, in a process of its own, and print
the ones that fail: `python -m tests.import_first MODULE...`. The third-party modules kvviz uses are
loaded once before the forks (they are not what is tested, and loading torch and transformers per
module would take minutes); no kvviz module is loaded before a fork, so each child imports its
module as the first of kvviz."""

from __future__ import annotations

import importlib
import os
import sys
import traceback


def third_party(names: list[str]) -> list[str]:
    """The modules outside kvviz that importing all of `names` loads, in the order they were loaded
    (found in a forked child, so this process loads no kvviz module)."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        for name in names:
            importlib.import_module(name)
        loaded = [m for m in sys.modules if m != "kvviz" and not m.startswith("kvviz.") and m != "__main__"]
        with os.fdopen(write, "w") as out:
            out.write("\n".join(loaded))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        loaded = got.read().split("\n")
    os.wait()
    return loaded


def main(names: list[str]) -> int:
    for lib in third_party(names):
        try:
            importlib.import_module(lib)
        except Exception:  # a module that only loads as part of another's import; its parent loads it
            pass
    assert not any(m == "kvviz" or m.startswith("kvviz.") for m in sys.modules)
    failed = 0
    for name in names:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(name)
            except BaseException:
                print(f"{name}:\n{traceback.format_exc()}", flush=True)
                os._exit(1)
            os._exit(0)
        failed += os.waitpid(pid, 0)[1] != 0
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
