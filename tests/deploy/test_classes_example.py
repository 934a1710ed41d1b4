"""deploy/classes.example.yaml: the product's loader accepts it, and the Envoy configs
that run the extproc set exactly its class header, class names and trusted marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.classes import ClassTable
from extproc.devstack import ROOT
from extproc.settings import load_class_table

EXAMPLE = ROOT / "deploy" / "classes.example.yaml"
HEADER_MUTATION = "envoy.filters.http.header_mutation"
EXT_PROC = "envoy.filters.http.ext_proc"
TIERS = {"premium": "critical", "batch": "sheddable"}


def _hcm(config: Path) -> dict[str, Any]:
    cfg = yaml.safe_load(config.read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]


# The configs with the ext_proc filter (envoy-front.yaml only spreads the load), but for
# envoy-epp.yaml: it is what a Kubernetes gateway generates, where the gateway's own route
# filters would set a class header.
CONFIGS = sorted(
    p
    for p in (ROOT / "envoy").glob("*.y*ml")
    if any(f["name"] == EXT_PROC for f in _hcm(p)["http_filters"]) and p.name != "envoy-epp.yaml"
)


def _table() -> ClassTable:
    return load_class_table(str(EXAMPLE))


def test_the_example_loads_with_the_trusted_marker() -> None:
    table = _table()
    assert [c.name for c in table.classes] == ["critical", "standard", "sheddable"]
    assert table.default == "standard"
    shares = {c.name: c.share.active_decode_blocks for c in table.classes}
    assert shares["critical"] == 1.0 > shares["standard"] > shares["sheddable"]
    sheddable = table.by_name("sheddable")
    assert sheddable.large_prompt_share is not None and sheddable.large_prompt_tokens
    assert table.trusted_marker is not None and table.trusted_marker[1]


def test_there_are_configs_with_ext_proc() -> None:
    names = {p.name for p in CONFIGS}
    assert {"envoy.yaml", "envoy-compose.yaml", "envoy-track-output.yaml"} <= names


def _tier(route: dict[str, Any]) -> str | None:
    for header in route["match"].get("headers", []):
        if header["name"] == "x-api-tier":
            return str(header["string_match"]["exact"])
    return None


def _mutations(route: dict[str, Any]) -> list[dict[str, Any]]:
    per_route = route.get("typed_per_filter_config", {}).get(HEADER_MUTATION)
    assert per_route is not None, f"route {route['match']} has no {HEADER_MUTATION} config"
    return list(per_route["mutations"]["request_mutations"])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_envoy_sets_the_example_class_header_and_marker(config: Path) -> None:
    table = _table()
    assert table.trusted_marker is not None
    marker, secret = table.trusted_marker
    hcm = _hcm(config)
    names = [f["name"] for f in hcm["http_filters"]]
    # Ahead of the Lua prefix reader and ext_proc, with per-route mutations only.
    assert names.index(HEADER_MUTATION) < names.index(EXT_PROC)
    assert names.index(HEADER_MUTATION) < names.index("envoy.filters.http.lua")
    assert "mutations" not in hcm["http_filters"][names.index(HEADER_MUTATION)]["typed_config"]

    seen_tiers = set()
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        if route["route"]["cluster"] != "workers":
            continue  # the admin API: no ext_proc
        tier = _tier(route)
        mutations = _mutations(route)
        if tier is None:
            # Every other route to the workers removes a client's marker, and only that.
            assert mutations == [{"remove": marker}], route["match"]
            continue
        seen_tiers.add(tier)
        set_to = {
            m["append"]["header"]["key"]: m["append"]["header"]["value"]
            for m in mutations
            if m["append"]["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
        }
        assert len(set_to) == len(mutations), route["match"]
        assert set_to == {table.header: TIERS[tier], marker: secret}, route["match"]
        table.by_name(TIERS[tier])  # a configured class
    assert seen_tiers == set(TIERS)
