"""Run ids: short, random, and made without loading any model code."""

import uuid


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]
