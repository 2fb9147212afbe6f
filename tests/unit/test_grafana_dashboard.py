"""The Grafana dashboard queries only series the cluster exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from telemetry import metrics

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "duet-dashboard.json"


def exported_series() -> set[str]:
    """What Ray's metrics agent serves for each family (it adds the `ray_` namespace)."""
    out = set()
    for f in metrics.FAMILIES:
        name = f"ray_{f.name}"
        out |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if f.kind == "histogram" else {name}
    return out


def test_every_query_names_an_exported_series():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    used = set()
    for p in panels:
        for t in p.get("targets", []):
            used |= set(re.findall(r"\bray_duet_\w+", t["expr"]))
    assert used and used <= exported_series(), sorted(used - exported_series())


def test_the_slo_variables_are_histogram_bucket_boundaries():
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    for name, family in (("ttft_slo", metrics.TTFT), ("tpot_slo", metrics.TPOT)):
        values = {float(o["value"]) for o in variables[name]["options"]}
        assert values <= set(map(float, family.buckets)), name
