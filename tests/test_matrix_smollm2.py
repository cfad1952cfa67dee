"""The detection matrix on the real model: every fault of the catalogue caught on its scenario, every
control clean. A file of its own, so that its minutes run beside the other files' (the workers take a
file at a time)."""

from __future__ import annotations

import pytest

from kvviz.catalogue.scenarios import SCENARIOS
from kvviz.models import load_model
from kvviz.runners.detection_matrix import audit


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2", device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_audit_on_smollm2_detects_every_fault_and_controls_are_clean(smollm2, name):
    rows = audit(smollm2, scenarios=[name])
    bad = [r for r in rows if not r.ok]
    assert not bad, bad
    assert [r.fault for r in rows] == ([SCENARIOS[name].fault, None] if SCENARIOS[name].fault else [None])
