"""The dashboards are built with grafana-foundation-sdk, and the shipped JSON is what Grafana's schema says.

The generator (helm/kareus/dashboards/generate.py) builds every dashboard with the SDK's typed
builders; here each shipped JSON file is decoded again by the SDK's own models (with the panel
plugins' option types registered), so a panel kind, option or field Grafana's schema does not have
would not round-trip. The re-encoded dashboard equals the file except for the field-config defaults
the SDK adds on decoding (`custom`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sdk = pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is in the dev extra")
from grafana_foundation_sdk.cog import plugins  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.models import dashboard as models  # noqa: E402

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "helm" / "kareus" / "dashboards"
FILES = sorted(DASHBOARD_DIR.glob("*.json"))


def without_custom(value):
    if isinstance(value, dict):
        return {k: without_custom(v) for k, v in value.items() if k != "custom"}
    if isinstance(value, list):
        return [without_custom(v) for v in value]
    return value


def test_the_generator_builds_with_the_sdk():
    spec = importlib.util.spec_from_file_location("kareus_dashboards_generate_sdk", DASHBOARD_DIR / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.db.Dashboard.__module__.startswith("grafana_foundation_sdk.")
    assert set(module.render_all()) == {f.name for f in FILES}
    assert "grafana_foundation_sdk.builders.timeseries" in sys.modules


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_the_shipped_json_round_trips_through_the_sdk_models(path):
    plugins.register_default_plugins()
    original = json.loads(path.read_text())
    decoded = models.Dashboard.from_json(original)
    kinds = {p.type_val for p in decoded.panels}
    assert kinds >= {"row", "stat", "timeseries"}
    for panel in decoded.panels:
        if panel.type_val != "row":  # each panel's options decode as its plugin's typed options
            assert type(panel.options).__module__.endswith(f".{panel.type_val}"), panel.title
            assert all(type(t).__module__.endswith(".prometheus") for t in panel.targets), panel.title
    again = json.loads(json.dumps(decoded, cls=JSONEncoder))
    assert without_custom(again) == original
