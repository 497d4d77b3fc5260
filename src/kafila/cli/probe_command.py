"""`kafila probe`: measure this device with llama.cpp and print its entry for a fleet file."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kafila.cli.backend_view import shout_idle_gpu
from kafila.cli.errors import fail, stderr, warn
from kafila.contracts import FleetDevice, ModelPricing
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.llama.loading import IdleGpu, LlamaUnavailable, load_llama, rebuild_for_gpu
from kafila.runtime.machine.memory import memory_pressure
from kafila.runtime.machine.model_probe import ModelStageProbe, model_pricing, probe_model_stages
from kafila.runtime.machine.probe import GIB, DeviceProbe, ProbeError, ProgressFn
from kafila.runtime.machine.probe_child import probe_in_child
from kafila.runtime.machine.this_machine import model_sha256, save_model_pricing


@contextmanager
def _progress(enabled: bool) -> Iterator[ProgressFn]:
    """A transient progress bar on stderr, so stdout carries only the result."""
    if not enabled:
        yield lambda _text, _fraction: None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("probing", total=1.0)

        def update(text: str, fraction: float) -> None:
            bar.update(task, description=text, completed=fraction)

        yield update


def _render_model_stages(stages: ModelStageProbe, console: Console) -> None:
    offset = stages.first_priced_block
    part = f" from block {offset} on, with the head (the whole does not fit in memory)," if offset else ""
    table = Table(title=f"{stages.model}{part} as local rings {stages.divisions} (decode, median of runs)")
    for column in ("blocks", "role", "ms per token"):
        table.add_column(column, justify="right")
    for stage in stages.stages:
        role = "head" if stage.is_head else "blocks"
        table.add_row(f"{stage.first_block + offset}–{stage.end_block - 1 + offset}", role, f"{stage.ms_per_token:.2f}")
    console.print(table)
    head = "" if stages.head_measured else " (the head was too small to time; priced at b)"
    console.print(
        f"priced for this model: b = {stages.bandwidth_gb_s:.2f} GB/s, b_head = {stages.head_bandwidth_gb_s:.2f} GB/s"
        f"{head}, o = {stages.overhead_us:.0f} µs",
        highlight=False,
    )


def _render(result: DeviceProbe, entry: FleetDevice, console: Console) -> None:
    console.print(
        f"[bold]{result.name}[/bold] measured with llama.cpp {result.llama_cpp_version} "
        f"({result.backend}, {result.threads} threads, {result.weight_type} weights) in {result.elapsed_s:.1f} s",
        highlight=False,
    )
    summary = Table(show_header=False)
    summary.add_column("figure")
    summary.add_column("value", justify="right")
    summary.add_column("how", style="dim")
    fit = result.fit
    summary.add_row(
        "memory bandwidth",
        f"{result.bandwidth_gb_s:.2f} GB/s",
        f"slope of decode time over weight bytes, R² {fit.r_squared:.4f}",
    )
    summary.add_row(
        "per-token overhead",
        f"{result.overhead_us:.1f} µs",
        "intercept of the same fit" + (" (negative, read as 0)" if result.intercept_clamped else ""),
    )
    summary.add_row(
        "arithmetic throughput", f"{result.tflops:.3f} TFLOPS", f"{result.prefill.tokens}-token prompt batch"
    )
    summary.add_row("available memory", f"{result.memory_gib:.2f} GiB", result.memory_source)
    if result.devices is not None:
        serving = escape(result.devices.summary(with_features=False))
        summary.add_row("serving on", serving, "as llama.cpp's ggml reports it")
    summary.add_row("CPU features", ", ".join(result.cpu_features) or "none reported", "as llama.cpp reports them")
    summary.add_row("weights", "repacked" if result.repack.repack else "not repacked", result.repack.reason)
    console.print(summary)
    if result.repack.note:
        console.print(f"[yellow]{result.repack.note}[/yellow]", highlight=False)

    steps = Table(title=f"Single-token decode ({result.statistic})")
    for column in ("width", "blocks", "weights", "step", "median", "runs"):
        steps.add_column(column, justify="right")
    for sample in result.decode:
        steps.add_row(
            str(sample.n_embd),
            str(sample.n_blocks),
            f"{sample.weight_bytes / 1e6:.1f} MB",
            f"{sample.step_ms:.2f} ms",
            f"{sample.median_ms:.2f} ms",
            str(sample.repetitions),
        )
    console.print(steps)
    if not result.steady:
        console.print(
            "[yellow]warning:[/yellow] this device was busy while it was measured (the step times scatter), "
            "so these figures are pessimistic; probe again when it is idle",
            highlight=False,
        )
    console.print("Fleet entry for this device:")
    console.print_json(json.dumps(entry.model_dump(exclude_none=True)))


def probe(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="Also price this GGUF model's own stages by running it as small local rings (about 30 s): "
            "narrow models are bound by per-kernel work, not bytes, and their head streams faster than their blocks. "
            "Kept: later sessions serving this model plan this machine with these numbers.",
        ),
    ] = None,
) -> None:
    """Measure this device's memory bandwidth, overhead, throughput and memory with llama.cpp."""
    if model is not None and not model.is_file():
        fail(f"no model file at {model}", as_json)
    if model is not None:  # before the device is measured, so a wrong file costs no wait
        try:
            read_manifest(model)
        except (OSError, ValueError) as error:
            fail(f"cannot price {model}: {error}", as_json)
    if model is not None:
        with contextlib.suppress(LlamaUnavailable):  # run_probe says it in its own words
            load_llama(shared_machine=True)  # the model's rings run their head in this process
    stages: ModelStageProbe | None = None
    pricing: ModelPricing | None = None
    try:
        with _progress(enabled=not as_json) as update:
            result = probe_in_child(update if model is None else lambda text, f: update(text, f / 2))
            if model is not None:
                memory = int(result.memory_gib * GIB)
                stages = probe_model_stages(model, lambda text, f: update(text, 0.5 + f * 0.45), memory_bytes=memory)
                update(f"hashing {model.name}", 0.95)
                pricing = model_pricing(stages, model_sha256(model))
    except ProbeError as error:
        fail(str(error), as_json)
    except (OSError, ValueError) as error:
        fail(f"cannot price {model}: {error}", as_json)
    pressure = memory_pressure(None)  # macOS: other apps' share of unified memory; on stderr
    if pressure is not None:
        warn(pressure)
    saved: Path | None = None
    if pricing is not None:
        try:
            saved = save_model_pricing(pricing)
        except OSError as error:  # the numbers are still worth printing
            Console(stderr=True).print(f"[yellow]warning:[/yellow] cannot keep this pricing for sessions: {error}")
    entry = result.fleet_device().priced(pricing)
    vendor = result.devices.idle_gpu if result.devices is not None else None
    if vendor is not None:  # on stderr in either mode: where it is seen, and stdout stays the result's
        shout_idle_gpu(IdleGpu(vendor, rebuild_for_gpu(vendor, result.llama_cpp_version)), stderr)
    if as_json:
        # The fleet entry a person pastes into a fleet file, then how it was measured.
        details = result.model_dump(exclude={"name", "bandwidth_gb_s", "overhead_us", "tflops", "memory_gib"})
        report = {**entry.model_dump(exclude_none=True), "probe": details}
        if stages is not None:
            report["model_stages"] = stages.model_dump()
        if pricing is not None:
            report["model_sha256"] = pricing.model_sha256
            report["model_pricing_saved"] = str(saved) if saved is not None else None
        print(json.dumps(report))
    else:
        console = Console()
        _render(result, entry, console)
        if stages is not None:
            _render_model_stages(stages, console)
        if saved is not None:
            console.print(
                f"Kept in {saved}: a session serving this model (by its sha256) plans this machine with these "
                "numbers, when it hosts or joins.",
                highlight=False,
                soft_wrap=True,
            )
