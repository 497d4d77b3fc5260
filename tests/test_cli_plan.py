"""`kafila plan` as a person or a script runs it: the real command line, run in this process (a
Python process per call spent most of this file's time starting up), and once as the console
script in a subprocess (`test_version`)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_gguf import write_other_family
from tiny_models import write_tiny_llama, write_tiny_model
from typer.testing import CliRunner

from kafila.cli.app import app
from kafila.planner.fleet import device_of
from kafila.runtime.gguf.manifest import read_manifest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("fleet-*.json"))


def kafila(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`kafila ARGS` through its command line (`cli.app`), its exit status, stdout and stderr apart."""
    argv = [str(arg) for arg in args]
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def write_fleet(path: Path, fleet: dict) -> Path:
    path.write_text(json.dumps(fleet))
    return path


DEVICES = [
    {"name": "laptop", "bandwidth_gb_s": 100.0, "overhead_us": 50, "memory_gib": 16, "nat": "ordinary", "rtt_ms": 40},
    {
        "name": "desktop",
        "bandwidth_gb_s": 400.0,
        "overhead_us": 40,
        "memory_gib": 8,
        "nat": "restrictive",
        "rtt_ms": 60,
    },
]


def assert_valid_plan(plan: dict, n_blocks: int, names: set[str]) -> None:
    assert set(plan) >= {
        "tier",
        "ring",
        "head",
        "ranges",
        "stage_ms",
        "bottleneck_ms",
        "utilisation",
        "edges",
        "ring_search",
        "planner_ms",
        "baselines",
    }
    serving = set(plan["ring"])  # the members who serve; the others stand by
    assert serving | set(plan.get("standby", [])) == names and plan["ring"][0] == plan["head"]
    assert not serving & set(plan.get("standby", []))
    ranges = [plan["ranges"][name] for name in plan["ring"][1:] + plan["ring"][:1]]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert set(plan["baselines"]) == {"uniform", "memory"}
    assert len(plan["edges"]) == (len(serving) if len(serving) > 1 else 0)


@pytest.mark.parametrize("fleet_path", EXAMPLES, ids=lambda p: p.stem)
def test_example_fleets_plan(fleet_path: Path) -> None:
    result = kafila("plan", fleet_path, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    fleet = json.loads(fleet_path.read_text())
    assert_valid_plan(plan, fleet["model"]["n_blocks"], {d["name"] for d in fleet["devices"]})
    assert plan["tier"] == "cost-model" and plan["ring_search"] == "exact"
    assert plan["bottleneck_ms"] == max(plan["stage_ms"].values())
    for baseline in plan["baselines"].values():  # the division of least time per token, among those that fit
        assert not baseline["fits"] or baseline["ms_per_token"] >= plan["ms_per_token"] * (1 - 1e-9)


def test_readable_output_names_members_and_baselines() -> None:
    result = kafila("plan", ROOT / "examples" / "fleet-lan.json")
    assert result.returncode == 0, result.stderr
    for word in ("gaming-pc-4090", "laptop-m3-pro", "uniform", "memory", "cost-model", "(head)"):
        assert word in result.stdout


def test_plan_for_a_gguf_file(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_blocks=6, wide_blocks=(2,))
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": DEVICES})
    result = kafila("plan", fleet, "--model", model, "--json")
    assert result.returncode == 0, result.stderr
    assert_valid_plan(json.loads(result.stdout), 6, {"laptop", "desktop"})


def test_plan_for_gemma(tmp_path: Path, gemma_path: Path) -> None:
    # On a LAN, under load, both serve.
    lan = [dict(d, rtt_ms=1) for d in DEVICES]
    loaded = {"anchor": "desktop", "devices": lan, "session": {"concurrency": 64}}
    result = kafila("plan", write_fleet(tmp_path / "fleet.json", loaded), "--model", gemma_path, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert_valid_plan(plan, 18, {"laptop", "desktop"})
    # The head reads 178 MB per token, ~47 blocks' worth: the faster member holds it, with few blocks.
    assert plan["head"] == "desktop" and plan["standby"] == []
    assert plan["ranges"]["desktop"][1] - plan["ranges"]["desktop"][0] < 9

    # One user pays the whole pass: the laptop's 100 ms relayed edge costs more than its blocks save.
    alone = {"anchor": "desktop", "devices": DEVICES}
    result = kafila("plan", write_fleet(tmp_path / "alone.json", alone), "--model", gemma_path, "--json")
    plan = json.loads(result.stdout)
    assert plan["standby"] == ["laptop"] and plan["ranges"] == {"desktop": [0, 18]}
    laptop = next(m for m in plan["members"] if m["device"] == "laptop")
    assert laptop["why"] == "costs-more" and laptop["words"].startswith("laptop stands by: its edges add 100.0 ms")


def test_plan_reads_a_round_trip_matrix(tmp_path: Path) -> None:
    """The fleet's measured round trips decide who serves; a bad matrix is refused with a clear error."""
    model = {
        "n_blocks": 24,
        "block_bytes": 100_000_000,
        "head_bytes": 200_000_000,
        "kv_bytes_per_token_per_block": 1000,
    }
    devices = [
        {"name": name, "memory_gib": 2, "bandwidth_gb_s": 50, "overhead_us": 100}
        for name in ("home", "near", "far-laptop")
    ]
    rtt_ms = {"home": {"near": 2, "far-laptop": 95}, "near": {"far-laptop": 95}}
    fleet = {"model": model, "session": {"context": 512, "concurrency": 4}, "devices": devices, "rtt_ms": rtt_ms}
    result = kafila("plan", write_fleet(tmp_path / "fleet.json", fleet), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert_valid_plan(plan, 24, {"home", "near", "far-laptop"})
    assert plan["standby"] == ["far-laptop"] and plan["ring_trip_ms"] == pytest.approx(2.0)
    assert [e["cost_ms"] for e in plan["edges"]] == [pytest.approx(2.0)] * 2
    assert plan["ms_per_token"] == pytest.approx(max(plan["stage_ms"].values()))

    readable = kafila("plan", tmp_path / "fleet.json")
    assert "far-laptop stands by: its edges add 94.0 ms" in " ".join(readable.stdout.split())

    del rtt_ms["near"]
    result = kafila("plan", write_fleet(tmp_path / "bad.json", fleet), "--json")
    assert result.returncode == 1
    assert "rtt_ms has no round trip between 'near' and 'far-laptop'" in json.loads(result.stdout)["error"]


def test_refusal_exits_2_naming_the_member(tmp_path: Path) -> None:
    small = [dict(d, memory_gib=0.001) for d in DEVICES]  # 1 MiB: the 2 MB head fits nowhere
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": small})
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_blocks=4, n_embd=256, n_ff=1024, n_vocab=4096)
    result = kafila("plan", fleet, "--model", model)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "short by" in lines[0]
    assert "laptop" in lines[0] or "desktop" in lines[0]
    as_json = kafila("plan", fleet, "--model", model, "--json")
    assert as_json.returncode == 2
    refusal = json.loads(as_json.stdout)
    assert refusal["device"] in {"laptop", "desktop"} and refusal["device"] in refusal["error"]
    assert refusal["shortfall_bytes"] > 0


BAD_FLEETS = {
    "not-json": ("{devices: [", "not valid JSON"),
    "no-devices": (json.dumps({"devices": []}), "devices"),
    "negative-memory": (json.dumps({"devices": [dict(DEVICES[0], memory_gib=-1)]}), "memory_gib"),
    "unknown-field": (json.dumps({"devices": [dict(DEVICES[0], colour="red")]}), "colour"),
    "duplicate-names": (json.dumps({"devices": [DEVICES[0], DEVICES[0]]}), "repeated: laptop"),
    "unknown-anchor": (json.dumps({"anchor": "ghost", "devices": DEVICES}), "anchor 'ghost'"),
    "bad-nat": (json.dumps({"devices": [dict(DEVICES[0], nat="friendly")]}), "nat"),
    "no-model": (json.dumps({"devices": DEVICES}), 'no "model" section'),
    "block-list-length": (
        json.dumps(
            {
                "model": {"n_blocks": 3, "block_bytes": [1, 2], "head_bytes": 1, "kv_bytes_per_token_per_block": 1},
                "devices": DEVICES,
            }
        ),
        "block_bytes lists 2 values but n_blocks is 3",
    ),
    "nan-bandwidth": ('{"devices": [{"name": "a", "memory_gib": 1, "bandwidth_gb_s": NaN}]}', "bandwidth_gb_s"),
    "infinite-memory": ('{"devices": [{"name": "a", "memory_gib": Infinity}]}', "memory_gib"),
    "huge-memory": (json.dumps({"devices": [dict(DEVICES[0], memory_gib=1e30)]}), "memory_gib"),
    "zero-context": (json.dumps({"session": {"context": 0}, "devices": DEVICES}), "session.context"),
    "too-many-blocks": (
        json.dumps(
            {
                "model": {"n_blocks": 100000, "block_bytes": 1, "head_bytes": 1, "kv_bytes_per_token_per_block": 1},
                "devices": DEVICES,
            }
        ),
        "model.n_blocks",
    ),
    "huge-block": (
        json.dumps(
            {
                "model": {"n_blocks": 2, "block_bytes": 2**60, "head_bytes": 1, "kv_bytes_per_token_per_block": 1},
                "devices": DEVICES,
            }
        ),
        "model: block_bytes",
    ),
    "too-many-members": (json.dumps({"devices": [dict(DEVICES[0], name=f"m{i}") for i in range(40)]}), "devices"),
    "list-not-object": ("[1, 2, 3]", "not a valid fleet"),
}


@pytest.mark.parametrize("case", BAD_FLEETS, ids=str)
def test_bad_fleets_get_a_clear_error(tmp_path: Path, case: str) -> None:
    content, message = BAD_FLEETS[case]
    path = tmp_path / "fleet.json"
    path.write_text(content)
    result = kafila("plan", path)
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    as_json = kafila("plan", path, "--json")
    assert as_json.returncode == 1 and message in json.loads(as_json.stdout)["error"]


def test_missing_fleet_and_bad_model_files(tmp_path: Path) -> None:
    missing = kafila("plan", tmp_path / "nope.json")
    assert missing.returncode == 1 and "no fleet file" in missing.stderr
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": DEVICES})
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    result = kafila("plan", fleet, "--model", not_gguf)
    assert result.returncode == 1 and "not a readable GGUF" in result.stderr and "Traceback" not in result.stderr
    absent = kafila("plan", fleet, "--model", tmp_path / "absent.gguf")
    assert absent.returncode == 1 and "no model file" in absent.stderr


def test_version() -> None:
    """The console script itself, as installed: `python -m kafila`."""
    result = subprocess.run(
        [sys.executable, "-m", "kafila", "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.startswith("kafila ")
    assert kafila("--version").stdout == result.stdout


def test_absurd_kv_cache_is_refused_not_overflowed(tmp_path: Path) -> None:
    fleet = {
        "model": {"n_blocks": 2, "block_bytes": 10, "head_bytes": 1, "kv_bytes_per_token_per_block": 2**24},
        "session": {"context": 2**24, "concurrency": 4096},
        "devices": DEVICES,
    }
    result = kafila("plan", write_fleet(tmp_path / "fleet.json", fleet), "--json")
    assert result.returncode == 2
    assert "GiB in all" in json.loads(result.stdout)["error"]


def test_a_family_that_cannot_be_split_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    """A division of a model the slicer cannot cut is no plan; one member runs it whole."""
    model = write_other_family(tmp_path / "mamba.gguf", "mamba")
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": DEVICES})
    result = kafila("plan", fleet, "--model", model, "--json")
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout)["error"]
    assert "'mamba' is not supported for splitting" in error and "qwen3moe" in error
    alone = kafila("plan", write_fleet(tmp_path / "one.json", {"devices": DEVICES[:1]}), "--model", model, "--json")
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["ranges"] == {"laptop": [0, 2]}


def test_single_member_plans_the_whole_model(tmp_path: Path) -> None:
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": DEVICES[:1]})
    model = write_tiny_llama(tmp_path / "tiny.gguf", n_blocks=3)
    result = kafila("plan", fleet, "--model", model, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["ranges"] == {"laptop": [0, 3]} and plan["edges"] == [] and plan["head"] == "laptop"


def test_a_mixture_of_experts_is_priced_by_the_experts_a_token_reads(tmp_path: Path) -> None:
    """`kafila plan --model` on a MoE header: a stage costs o + (dense bytes + k/n of its expert
    bytes) / b, not all it holds; the readable plan says so."""
    fleet = write_fleet(tmp_path / "fleet.json", {"devices": DEVICES[:1]})
    model = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", n_blocks=4)
    manifest = read_manifest(model)
    assert manifest.expert_bytes is not None
    result = kafila("plan", fleet, "--model", model, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    laptop = DEVICES[0]
    read = sum(b - e + e * 2 / 8 for b, e in zip(manifest.block_bytes, manifest.expert_bytes, strict=True))
    expected_s = laptop["overhead_us"] * 1e-6 + (read + manifest.head_bytes) / (laptop["bandwidth_gb_s"] * 1e9)
    assert plan["bottleneck_ms"] == pytest.approx(expected_s * 1e3, rel=1e-3)
    reading_s = plan["bottleneck_ms"] * 1e-3 - laptop["overhead_us"] * 1e-6
    assert reading_s < 0.6 * manifest.total_bytes / (laptop["bandwidth_gb_s"] * 1e9)  # far from reading it all
    readable = kafila("plan", fleet, "--model", model)
    assert "a mixture of 8 experts, 2 a token" in " ".join(readable.stdout.split()), readable.stdout


def test_a_fleet_file_can_describe_a_mixture_of_experts(tmp_path: Path) -> None:
    """The fleet file's model takes expert bytes, n and k; the same bytes declared dense cost more
    a token, and an impossible routing is a clear error."""
    model = {"n_blocks": 4, "block_bytes": 10**9, "head_bytes": 10**8, "kv_bytes_per_token_per_block": 1024}
    moe = {**model, "expert_bytes": [9 * 10**8] * 4, "experts": 64, "experts_used": 4}

    def bottleneck(entry: dict) -> float:
        fleet = write_fleet(tmp_path / "fleet.json", {"model": entry, "devices": DEVICES})
        result = kafila("plan", fleet, "--json")
        assert result.returncode == 0, result.stderr
        return float(json.loads(result.stdout)["bottleneck_ms"])

    assert bottleneck(moe) < 0.3 * bottleneck(model)  # 1/16 of 90% of every block is read a token
    fleet = write_fleet(tmp_path / "bad.json", {"model": {**moe, "experts_used": 65}, "devices": DEVICES})
    result = kafila("plan", fleet)
    assert result.returncode == 1 and "65 of 64 experts" in result.stderr and "Traceback" not in result.stderr


def test_non_utf8_fleet_file(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_bytes(b"\xff\xfe{}")
    result = kafila("plan", path)
    assert result.returncode == 1 and "cannot read fleet file" in result.stderr


def test_memory_sizes_people_type_and_what_a_device_then_lends() -> None:
    from kafila.cli.sizes import parse_memory
    from kafila.contracts import FleetDevice

    assert parse_memory(None) is None
    assert parse_memory("8G") == 8 * 10**9 and parse_memory("12GiB") == 12 * 2**30 and parse_memory(" 512MB ") == 512e6
    for bad in ("lots", "512", "-1G"):
        with pytest.raises(ValueError, match="--memory"):
            parse_memory(bad)
    device = FleetDevice(name="pc", memory_gib=16.0)
    assert device.lending(None) is device
    assert device_of(device.lending(4 * 2**30)).memory_bytes == 4 * 2**30
    assert device.lending(64 * 2**30).memory_gib == 16.0  # lending more than is free lends what is free
