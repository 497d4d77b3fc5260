"""A tiny model that makes tool calls, for real agents (Claude Code, …) to run one turn against.

A random tiny model (`tiny_models`) answers a tool-calling agent with text or nothing: it never
chooses to call. This one is the tiny qwen3 with Qwen's tool template and `<tool_call>` and
`</tool_call>` as tokens of its own, whose weights are set so that, whatever it has read, its
next token ranks in one of two ways: after `"`, `"` first (a string it opens, it closes), then
`}`; after anything else, `<tool_call>` first, then `</tool_call>`, the end of text, `"`, `}`, `:` and `,`;
every other token alike after them. Its blocks add nothing to the residual stream, so the last
hidden state is the last token's embedding; with the output tied to the embeddings, a token's
logit is its embedding's dot product with the last token's, over the rms. Each embedding is a
shared part, the token's score along a second axis (every score positive, so the product orders
tokens by score whatever the last token), and, for `"` alone, a third axis, on which `"` meets
itself.

So the model opens a call at once; the server's grammar (in tool choice "auto") then holds the
call to a tool's schema, where it closes each string at once and leaves out what it may (writing
`<tool_call>` inside a string is what it would do otherwise); it ends the reply after
`</tool_call>`. Everything else (the template, the grammar, the reader, the
dialect, the agent) is as it is for any model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quantize
from tiny_models import write_tiny_model

QWEN_TEMPLATE = (Path(__file__).parent.parent / "fixtures" / "qwen2.5-tools.jinja").read_text()
CALL_TOKENS = ("<tool_call>", "</tool_call>")
# Scores along the second axis: large gaps, so that sampling at temperature 1 draws as greedy does.
PREFERRED = (
    ("<tool_call>", 400.0),
    ("</tool_call>", 300.0),
    ("</s>", 200.0),
    ('"', 100.0),
    ("}", 50.0),
    (":", 20.0),
    (",", 10.0),
)
QUOTE_SELF = 300.0  # `"` after `"`: 100² + 300² beats `<tool_call>`'s 400 × 100


def write_tool_caller(path: Path, prefer: Sequence[tuple[str, float]] = ()) -> Path:
    """Write the model to `path` (a GGUF file); the same bytes every time. `prefer`: more tokens
    ranked above the rest, with their scores (below `,`'s): ("e", 5.0) makes a name the grammar
    leaves open start with "e" (Codex's exec_command among its tools)."""
    write_tiny_model(path, "qwen3", n_blocks=2, chat_template=QWEN_TEMPLATE, extra_specials=CALL_TOKENS)
    reader = GGUFReader(str(path), "r+")
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in _token_parts(reader)]
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    embd = tensors["token_embd.weight"]
    n_vocab, n_embd = len(tokens), int(embd.shape[0])
    half = n_embd // 2  # the two axes in different Q8_0 blocks of 32, so each is kept exactly
    rows = np.zeros((n_vocab, n_embd), dtype=np.float32)
    rows[:, 0] = 1.0
    rows[:, half] = 1.0
    for text, score in (*PREFERRED, *prefer):
        rows[_ids(tokens, text), half] = score
    rows[_ids(tokens, '"'), half // 2] = QUOTE_SELF
    _write(embd, rows)
    for tensor in reader.tensors:
        if tensor.name.endswith(("attn_output.weight", "ffn_down.weight")):
            tensor.data[...] = 0  # zero bytes are a zero tensor in F32, F16 and Q8_0 alike
    tensors["output_norm.weight"].data[...] = 1.0
    reader.data.flush()
    return path


def _ids(tokens: list[str], text: str) -> list[int]:
    """The tokens that write `text`: the token itself, or a character's byte token."""
    names = [text] + ([f"<0x{ord(text):02X}>"] if len(text) == 1 else [])
    return [tokens.index(name) for name in names if name in tokens]


def _token_parts(reader: GGUFReader) -> list[int]:
    """Where each token's text is among the field's parts."""
    return list(reader.fields["tokenizer.ggml.tokens"].data)


def _write(tensor: ReaderTensor, rows: np.ndarray) -> None:
    kind, data = tensor.tensor_type, tensor.data
    if kind == GGMLQuantizationType.F32:
        data[...] = rows
    elif kind == GGMLQuantizationType.F16:
        data[...] = rows.astype(np.float16)
    else:
        data[...] = quantize(rows, kind).reshape(data.shape)
