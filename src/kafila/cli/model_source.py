"""What `--model` names: a local GGUF file, or a model on a Hugging Face hub that the host downloads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kafila.cli.bars import transfer_bars
from kafila.cli.errors import fail, stderr, warn
from kafila.contracts import HubModel
from kafila.hub.fetch import ModelFetchError, fetch_model
from kafila.hub.ranges import read_hub_header
from kafila.hub.reference import PREFIX, HubReference, ModelNameError, parse_reference

MODEL_HELP = (
    "A GGUF file, or a model on the Hugging Face hub, downloaded once into its cache and checked: "
    "hf://org/repo:QUANT (e.g. hf://Qwen/Qwen3-8B-GGUF:Q4_K_M), org/repo:QUANT, hf://org/repo/file.gguf. "
    "HF_TOKEN and HF_ENDPOINT are honoured. Default: the bundled SmolLM2-135M-Instruct."
)


def model_file(value: str) -> Path:
    """The local file `value` names, downloading it first where it names one on the hub."""
    return model_source(value, False)[0]


def model_source(value: str, for_members: bool) -> tuple[Path, HubModel | None]:
    """The local file `value` names, downloading it first where it names one on the hub; and, with
    `for_members`, the model on the hub at that file's commit, known from its headers, for members
    to fetch their stages from (None for a local file, or where the hub cannot say)."""
    local = Path(value).expanduser()
    try:
        reference = parse_reference(value, local_file_exists=local.is_file())
    except ModelNameError as error:
        fail(str(error), False)
    if reference is None:
        return local, None
    try:
        with transfer_bars() as update:
            fetched = fetch_model(reference, update)
    except KeyboardInterrupt:
        fail("interrupted while the model was fetched", False, 130)
    except (ModelFetchError, ModelNameError) as error:
        taken = (
            "" if value.strip().startswith(PREFIX) else f" (there is no local file {value}: it was taken as a hub name)"
        )
        fail(f"{error}{taken}", False)
    if fetched.offline is not None:
        warn(f"the hub could not be reached ({fetched.offline}): serving the copy cached from commit {fetched.commit}")
    stderr.print(f"model {reference}: {fetched.path}", highlight=False, soft_wrap=True)
    hub = _hub_model(reference, fetched.commit) if for_members and fetched.offline is None else None
    return fetched.path, hub


def _hub_model(reference: HubReference, commit: str) -> HubModel | None:
    """The model's headers at the commit downloaded, for members to fetch their stages by range;
    None, said, where they cannot be read: the host then sends every stage itself."""
    try:
        with stderr.status(f"reading {reference}'s header at {commit[:12]} for the members"):
            return read_hub_header(dataclasses.replace(reference, revision=commit)).model
    except ModelFetchError as error:
        warn(f"the hub's header could not be read ({error}): members receive their stages from this machine")
        return None
