"""Small helpers every layer may use (ids, JSON with line numbers, a GC pause); they import only
kvviz.errors."""
