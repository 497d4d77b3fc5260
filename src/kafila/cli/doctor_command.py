"""`kafila doctor`: before a session, what this machine brings to it and what would stop it, each
problem with what to do about it.

`gather` measures (the rendezvous, UDP to its STUN port, the round trip, the NAT, llama.cpp's
build, free memory, the model's family); `judge` is pure and turns those findings into checks,
so the advice is tested without a network or a GPU.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kafila.cli.addresses import parse_host_port
from kafila.cli.backend_view import shout_idle_gpu
from kafila.cli.errors import fail
from kafila.contracts import NatClass
from kafila.network.rendezvous_server import DEFAULT_HTTP_PORT
from kafila.portability import ignore_udp_connection_resets, run
from kafila.runtime.gguf.families import UnsupportedFamily
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import SliceError, check_family
from kafila.runtime.llama.backends import backend_report
from kafila.runtime.llama.loading import (
    IdleGpu,
    LlamaUnavailable,
    gpu_present,
    load_llama,
    rebuild_for_gpu,
    system_info,
)
from kafila.runtime.machine.memory import available_memory
from kafila.session.presence import RendezvousUnreachable, reach, rendezvous_endpoints

Status = Literal["ok", "warn", "fail", "skip"]
FAR_RTT_MS = 150.0  # past this, each token's trip round the ring costs noticeably
MARK = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]fail[/red]", "skip": "—"}


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class Findings:
    """What `gather` measured; None where it could not be (or was not asked)."""

    rendezvous: str | None = None  # HOST:PORT asked about
    rendezvous_error: str | None = None  # no kafila rendezvous answered there
    udp_error: str | None = None  # its STUN port did not answer
    rtt_ms: float | None = None
    nat_class: NatClass | None = None
    nat_notes: tuple[str, ...] = ()
    llama_error: str | None = None  # llama.cpp does not load
    llama_version: str = ""
    backends: tuple[str, ...] = ()  # as llama.cpp's system info names them: CPU, CUDA, Metal, ...
    gpu_offload: bool = False  # the build can put layers on a GPU
    gpu_present: str | None = None  # a GPU this machine has: "NVIDIA" (nvidia-smi), "Apple" (Apple silicon)
    serving: str | None = None  # which devices serve stages, as `BackendReport.summary` says it
    free_memory: int | None = None  # bytes a stage may fill
    model: str | None = None
    model_unreadable: str | None = None  # no GGUF file there
    model_error: str | None = None  # a family, or a shape, that cannot be split
    model_architecture: str | None = None
    model_bytes: int | None = None


def judge(found: Findings) -> list[Check]:
    """Every check, in the order a person would fix them."""
    return [
        *_network(found),
        _llama(found),
        _memory(found),
        _model(found),
    ]


def _network(found: Findings) -> list[Check]:
    if found.rendezvous is None:
        skip = "pass --rendezvous HOST:PORT (what `kafila join` is given) to check it"
        return [Check("rendezvous", "skip", "not asked", skip)]
    if found.rendezvous_error is not None:
        return [
            Check(
                "rendezvous", "fail", found.rendezvous_error,
                "check the address and port (the host prints them in its join line), that the rendezvous runs, "
                "and that this network lets TCP out to it",
            )
        ]  # fmt: skip
    checks = [Check("rendezvous", "ok", f"a kafila rendezvous answers at {found.rendezvous}")]
    if found.udp_error is not None:
        checks.append(
            Check(
                "UDP", "fail", found.udp_error,
                "links between members are UDP (QUIC): allow outbound UDP on this network, or ask the rendezvous's "
                "operator to open its STUN port (UDP 3478 by default)",
            )
        )  # fmt: skip
        return checks
    checks.append(Check("UDP", "ok", "the rendezvous's STUN port answers"))
    if found.rtt_ms is not None:
        far = found.rtt_ms > FAR_RTT_MS
        advice = (
            "a ring's tokens cross every link in turn: members far apart serve fewer tokens a second" if far else ""
        )
        checks.append(Check("round trip", "warn" if far else "ok", f"{found.rtt_ms:.0f} ms to the rendezvous", advice))
    if found.nat_class is None:
        notes = "; ".join(found.nat_notes) or "the rendezvous could not tell"
        checks.append(Check("NAT", "warn", f"unclassified: {notes}", "members plan it as unknown; links still try"))
    elif found.nat_class is NatClass.RESTRICTIVE:
        checks.append(
            Check(
                "NAT", "warn", "restrictive (a symmetric NAT)",
                "its links to other restrictive members go through the rendezvous's relay (slower); a router "
                "setting such as UPnP or a port forward makes it direct",
            )
        )  # fmt: skip
    else:
        checks.append(Check("NAT", "ok", f"{found.nat_class.value}: links to most members can be direct"))
    return checks


def _llama(found: Findings) -> Check:
    if found.llama_error is not None:
        return Check("llama.cpp", "fail", found.llama_error, "reinstall kafila: pip install --force-reinstall kafila")
    build = f"llama-cpp-python {found.llama_version}, backends: {', '.join(found.backends) or 'CPU'}"
    if found.serving is not None:
        build += f"; serving on {found.serving}"
    if found.gpu_present is not None and not found.gpu_offload:
        how = rebuild_for_gpu(found.gpu_present, found.llama_version)
        return Check("llama.cpp", "warn", f"{build}: this machine's {found.gpu_present} GPU sits idle", how)
    return Check("llama.cpp", "ok", build + (" (GPU offload)" if found.gpu_offload else ""))


def _memory(found: Findings) -> Check:
    if found.free_memory is None:
        return Check("memory", "warn", "cannot tell how much is free", "`kafila host --memory 8G` says what to lend")
    free = f"{_gib(found.free_memory)} free"
    if found.model_bytes is not None and found.model_bytes > found.free_memory:
        return Check(
            "memory", "ok", f"{free}; the model ({_gib(found.model_bytes)}) does not fit here alone",
            "that is what a session is for: it divides the model by what each member lends",
        )  # fmt: skip
    return Check("memory", "ok", free)


def _model(found: Findings) -> Check:
    if found.model is None:
        return Check("model", "skip", "not asked", "pass --model PATH.gguf to check that it can be split")
    if found.model_unreadable is not None:
        return Check("model", "fail", found.model_unreadable, "give the path of a GGUF model file")
    if found.model_error is not None:
        return Check("model", "fail", found.model_error, "a model of a family Kafila splits: see the README")
    return Check("model", "ok", f"{found.model_architecture}: Kafila can split it")


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def gather(rendezvous: tuple[str, int] | None, model: Path | None) -> Findings:
    """Measure what `judge` needs (a minute at most: the NAT tests wait for answers)."""
    found: dict[str, object] = {}
    if rendezvous is not None:
        found |= _measure_network(rendezvous)
    found |= _measure_llama()
    if model is not None:
        found |= _measure_model(model)
    return Findings(**found)  # type: ignore[arg-type]


def _measure_network(rendezvous: tuple[str, int]) -> dict[str, object]:
    found: dict[str, object] = {"rendezvous": f"{rendezvous[0]}:{rendezvous[1]}"}
    try:
        _, stun = rendezvous_endpoints(rendezvous)
    except RendezvousUnreachable as error:
        return found | {"rendezvous_error": str(error)}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", 0))
        ignore_udp_connection_resets(sock)
        try:
            reached = run(reach(sock, stun))  # what `kafila join` learns as it joins
        except RendezvousUnreachable as error:
            return found | {"udp_error": str(error)}
    report = reached.nat
    return found | {
        "rtt_ms": reached.rtt_ms,
        "nat_class": report.nat_class if report is not None else None,
        "nat_notes": tuple(report.notes) if report is not None else ("the NAT tests did not finish",),
    }


def _measure_llama() -> dict[str, object]:
    try:
        llama_cpp = load_llama()
    except LlamaUnavailable as error:
        return {"llama_error": str(error)}
    info = system_info()
    backends = tuple(dict.fromkeys(part.split(":", 1)[0].strip() for part in info.split("|") if ":" in part))
    gpu_offload = bool(llama_cpp.llama_supports_gpu_offload())
    found: dict[str, object] = {
        "llama_version": str(getattr(llama_cpp, "__version__", "?")),
        "backends": backends,
        "gpu_offload": gpu_offload,
        "gpu_present": gpu_present(),
    }
    try:
        found["serving"] = backend_report().summary()
    except LlamaUnavailable:  # ggml's device calls are not where they should be: the build is still named
        pass
    try:
        found["free_memory"] = available_memory(gpu_offload)[0]
    except Exception:  # judged as "cannot tell"
        pass
    return found


def _measure_model(model: Path) -> dict[str, object]:
    found: dict[str, object] = {"model": str(model)}
    try:
        manifest = read_manifest(model)
    except (OSError, ValueError) as error:
        return found | {"model_unreadable": f"cannot read {model}: {error}"}
    try:
        check_family(manifest.architecture or "", manifest.n_blocks)  # the slicer's own refusal
    except (UnsupportedFamily, SliceError) as error:
        return found | {"model_error": str(error)}
    return found | {"model_architecture": manifest.architecture, "model_bytes": model.stat().st_size}


def doctor(
    rendezvous: Annotated[
        str | None,
        typer.Option("--rendezvous", help="HOST:PORT of the rendezvous the session will use (as `kafila join`)."),
    ] = None,
    model: Annotated[Path | None, typer.Option("--model", help="A GGUF model to check that Kafila can split.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Check this machine before a session: the rendezvous, UDP, round trip and NAT, llama.cpp's
    build (and an idle GPU), free memory, and whether the model can be split; each problem with
    what to do. Exits 1 when a check fails."""
    try:
        address = parse_host_port(rendezvous.strip(), DEFAULT_HTTP_PORT) if rendezvous is not None else None
    except ValueError as error:
        fail(f"bad --rendezvous: {error}", as_json)
    found = gather(address, model)
    checks = judge(found)
    failed = any(check.status == "fail" for check in checks)
    if as_json:
        print(json.dumps({"checks": [asdict(check) for check in checks], "ok": not failed}))
    else:
        table = Table(title="kafila doctor", show_lines=False)
        for column in ("check", "", "what was found", "what to do"):
            table.add_column(column)
        for check in checks:
            table.add_row(check.name, MARK[check.status], escape(check.detail), escape(check.advice))
        console = Console()
        console.print(table)
        if found.gpu_present is not None and found.llama_error is None and not found.gpu_offload:
            shout_idle_gpu(IdleGpu(found.gpu_present, rebuild_for_gpu(found.gpu_present, found.llama_version)), console)
    if failed:
        raise typer.Exit(1)
