"""The package graph read from the source keeps the layering docs/architecture.md draws: no
cycle, and no sideways arrow between service packages that should not know each other."""

from __future__ import annotations

from package_graph import cycles, imports, layers


def test_the_packages_import_one_another_without_a_cycle() -> None:
    edges = imports()
    assert ("session", "network") in edges and ("api", "serving") in edges  # the reader reads real imports
    assert cycles(edges) == []


def test_no_service_package_imports_one_it_should_not_know() -> None:
    edges = imports()
    forbidden = {
        "network": {"planner", "runtime", "serving", "session", "api", "cli", "hub"},
        "runtime": {"network", "serving", "session", "api", "cli"},
        "serving": {"network", "session", "api", "cli"},
        "planner": {"network", "runtime", "serving", "session", "api", "cli", "hub"},
        "api": {"session", "network", "cli"},
        "wire": {"planner", "network", "runtime", "serving", "session", "api", "cli", "hub"},
        "contracts": {"planner", "network", "runtime", "serving", "session", "api", "cli", "hub", "wire"},
    }
    crossing = sorted((a, b) for a, b in edges if b in forbidden.get(a, set()))
    assert crossing == []


def test_the_command_line_is_on_top_and_the_contracts_over_leaves_only() -> None:
    edges = imports()
    assert layers(edges)[-1] == ["cli"]
    leaves = {"untrusted", "units", "validation", "portability"}
    assert {b for a, b in edges if a == "contracts"} <= leaves
