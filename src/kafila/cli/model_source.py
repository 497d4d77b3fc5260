"""What `--model` names: a local GGUF file, or a model on a Hugging Face hub that the host downloads."""

from __future__ import annotations

from pathlib import Path

from kafila.cli.bars import transfer_bars
from kafila.cli.errors import fail, stderr, warn
from kafila.hub.fetch import ModelFetchError, fetch_model
from kafila.hub.reference import PREFIX, ModelNameError, parse_reference

MODEL_HELP = (
    "A GGUF file, or a model on the Hugging Face hub, downloaded once into its cache and checked: "
    "hf://org/repo:QUANT (e.g. hf://Qwen/Qwen3-8B-GGUF:Q4_K_M), org/repo:QUANT, hf://org/repo/file.gguf. "
    "HF_TOKEN and HF_ENDPOINT are honoured. Default: the bundled SmolLM2-135M-Instruct."
)


def model_file(value: str) -> Path:
    """The local file `value` names, downloading it first where it names one on the hub."""
    local = Path(value).expanduser()
    try:
        reference = parse_reference(value, local_file_exists=local.is_file())
    except ModelNameError as error:
        fail(str(error), False)
    if reference is None:
        return local
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
    return fetched.path
