"""`kafila plan FLEET.json`: plan a session on paper, from a fleet file and a model's header."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from kafila.cli.errors import fail
from kafila.cli.plan_view import render_plan
from kafila.planner import PlanRefused
from kafila.planner.fleet import Fleet, device_of
from kafila.planner.report import plan_report
from kafila.planner.who_serves import plan_serving_host_choice
from kafila.runtime.gguf.families import UnsupportedFamily
from kafila.runtime.gguf.gguf_file import GGUFFormatError
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import SliceError, check_family

stdout = Console()

EXIT_BAD_INPUT = 1
EXIT_REFUSED = 2


def _validation_message(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "file"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


def _load_fleet(path: Path, as_json: bool) -> Fleet:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"no fleet file at {path}", as_json, EXIT_BAD_INPUT)
    except (OSError, UnicodeDecodeError) as error:
        fail(f"cannot read fleet file {path}: {error}", as_json, EXIT_BAD_INPUT)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        fail(f"{path} is not valid JSON: {error}", as_json, EXIT_BAD_INPUT)
    try:
        return Fleet.model_validate(raw)
    except ValidationError as error:
        fail(f"{path} is not a valid fleet: {_validation_message(error)}", as_json, EXIT_BAD_INPUT)


def plan(
    fleet_path: Annotated[Path, typer.Argument(metavar="FLEET.json", help="Members and, optionally, the model.")],
    model: Annotated[
        Path | None, typer.Option("--model", help="A GGUF file to plan for, read without loading weights.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Plan a session: who serves, ring order, head, block division and admission."""
    fleet = _load_fleet(fleet_path, as_json)
    if model is not None:
        try:
            manifest = read_manifest(model)
        except (FileNotFoundError, GGUFFormatError, ValidationError) as error:
            fail(str(error), as_json, EXIT_BAD_INPUT)
    elif fleet.model is not None:
        try:
            manifest = fleet.model.manifest()
        except ValidationError as error:
            fail(f"{fleet_path}: model: {_validation_message(error)}", as_json, EXIT_BAD_INPUT)
    else:
        fail(f'{fleet_path} has no "model" section; give one or pass --model MODEL.gguf', as_json, EXIT_BAD_INPUT)
    devices = [device_of(d) for d in fleet.devices]  # the fleet schema's bounds imply the device's
    if len(devices) > 1 and manifest.architecture is not None:
        try:  # a division the slicer would refuse is no plan: say so before any member is counted on
            check_family(manifest.architecture, manifest.n_blocks)
        except (UnsupportedFamily, SliceError) as error:
            fail(str(error), as_json, EXIT_REFUSED)
    started = time.perf_counter()
    try:
        # As a session hosted on the anchor chooses (`kafila host`): the same members, ring and division.
        hosted = sorted(devices, key=lambda device: device.name != fleet.anchor_name)
        choice = plan_serving_host_choice(manifest, hosted, fleet.session, fleet.round_trips())
    except PlanRefused as refusal:
        fail(str(refusal), as_json, EXIT_REFUSED, device=refusal.device, shortfall_bytes=refusal.shortfall_bytes)
    report = plan_report(choice.plan, time.perf_counter() - started, choice)
    if as_json:
        print(report.model_dump_json())
    else:
        experts = ""
        if manifest.expert_bytes is not None:  # priced by what a token reads: k of n experts
            read = sum(manifest.read_bytes()) / sum(manifest.block_bytes)
            experts = (
                f"; a mixture of {manifest.experts} experts, {manifest.experts_used} a token: decoding reads "
                f"{read:.0%} of the blocks' bytes"
            )
        stdout.print(
            f"Model [bold]{manifest.name}[/bold]: {manifest.n_blocks} blocks, "
            f"{manifest.total_bytes / 1e9:.2f} GB; context {fleet.session.context} × "
            f"{fleet.session.concurrency} concurrent{experts}",
            highlight=False,
        )
        render_plan(report, stdout)
