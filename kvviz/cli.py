"""`python -m kvviz`: the command line for scripts and CI."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def cmd_fetch_model(args: argparse.Namespace) -> int:
    """Fetch and convert a model now (e.g. at image build time) so later loads are fast."""
    from .models import ModelError, load_model

    try:
        m = load_model(args.model, device="cpu")
    except ModelError as e:
        print(f"kvviz: error: {e}", file=sys.stderr)
        return 2
    cfg = m.config
    print(f"{m.name}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{sum(p.numel() for p in m.model.parameters()):,} parameters, weights sha256 {m.fingerprint[:16]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvviz", description=__doc__)
    p.add_argument("--version", action="version", version=f"kvviz {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="download and convert a model into the kvviz cache")
    fetch.add_argument("model", nargs="?", default="smollm2", help="smollm2 (default), tiny-llama, tiny-gpt2 or a path")
    fetch.set_defaults(func=cmd_fetch_model)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
