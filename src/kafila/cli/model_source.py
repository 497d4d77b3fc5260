"""What `--model` names: a local GGUF file, or a model on a Hugging Face hub. A host that serves
every block downloads the whole file; a host with members plans from the hub's header and fetches
only what it serves (`session.host_model`), and each member fetches its own stage. The header's
read may begin before the command imports the rest of itself (`cli.early_start.HeaderRead`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kafila.cli.bars import transfer_bars
from kafila.cli.early_start import HeaderRead
from kafila.cli.errors import fail, stderr, warn
from kafila.hub.fetch import ModelFetchError, cached_whole, fetch_model
from kafila.hub.ranges import read_hub_header
from kafila.hub.reference import PREFIX, HubReference, ModelNameError, parse_reference
from kafila.session.host_model import HubOnlyModel, LocalModel

MODEL_HELP = (
    "A GGUF file, or a model on the Hugging Face hub: hf://org/repo:QUANT (e.g. hf://Qwen/Qwen3-8B-GGUF:Q4_K_M), "
    "org/repo:QUANT, hf://org/repo/file.gguf. Alone, the host downloads it once into the hub's cache and checks "
    "it; with members, it reads the model's header and fetches only its own share, and each member fetches its "
    "own. HF_TOKEN and HF_ENDPOINT are honoured. Default: the bundled SmolLM2-135M-Instruct."
)


def model_source(
    value: str, for_members: bool, begun: HeaderRead | None = None
) -> LocalModel | HubOnlyModel:  # alone: a LocalModel
    """The model `value` names. A local file as it is. On the hub: alone (not `for_members`), the
    whole file, downloaded once and checked; with members, the model known by its header at the
    commit its revision names (`HubOnlyModel`: nothing of the weights fetched yet), or the whole
    file where an earlier download left it here (then the stages are cut from it and members
    check theirs against them), or, where the header cannot be read, the whole file downloaded.
    `begun`: the header's read already under way (`header_read_begun`)."""
    local = Path(value).expanduser()
    try:
        reference = parse_reference(value, local_file_exists=local.is_file())
    except ModelNameError as error:
        fail(str(error), False)
    if reference is None:
        return LocalModel(local)
    if for_members:
        from_header = _from_header(reference, begun if begun is not None and begun.reference == reference else None)
        if from_header is not None:
            return from_header
    try:
        with transfer_bars() as update:
            fetched = fetch_model(reference, update)
    except KeyboardInterrupt:
        fail("interrupted while the model was fetched", False, 130)
    except (ModelFetchError, ModelNameError) as error:
        fail(f"{error}{_taken(value)}", False)
    if fetched.offline is not None:
        warn(f"the hub could not be reached ({fetched.offline}): serving the copy cached from commit {fetched.commit}")
    stderr.print(f"model {reference}: {fetched.path}", highlight=False, soft_wrap=True)
    return LocalModel(fetched.path)


def _taken(value: str) -> str:
    return "" if value.strip().startswith(PREFIX) else f" (there is no local file {value}: it was taken as a hub name)"


def _from_header(reference: HubReference, begun: HeaderRead | None) -> LocalModel | HubOnlyModel | None:
    """The model on the hub from its header, for members to fetch their stages from, and this host
    its own; None, said, where the header cannot be read (the whole file is then downloaded, and
    the host sends every stage itself). A refusal that no download would pass ends the command."""
    try:
        with stderr.status(f"reading {reference}'s header from the hub"):
            header = read_hub_header(reference, read=begun.result() if begun is not None else None)
    except KeyboardInterrupt:
        fail("interrupted while the model's header was read", False, 130)
    except ModelNameError as error:
        fail(f"{error}", False)
    except ModelFetchError as error:
        warn(f"the hub's header could not be read ({error}): downloading the whole model, and sending the stages")
        return None
    model = header.model
    at_commit = dataclasses.replace(reference, revision=model.commit)
    whole = cached_whole(model)
    if whole is not None:
        stderr.print(f"model {reference}: {whole} (downloaded before; members fetch their stages from the hub)")
        return LocalModel(whole, hub=model)
    stderr.print(
        f"model {model.label}: planned from its header; this machine fetches only its own share, each member its own",
        highlight=False,
        soft_wrap=True,
    )
    return HubOnlyModel(header, at_commit)
