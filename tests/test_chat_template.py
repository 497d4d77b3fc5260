"""Chat templates from the GGUF, rendered as llama.cpp's own Python binding renders them.

gpt-oss's harmony template (tests/fixtures) carried by a tiny gpt-oss, cut in two: the prompt
Kafila's chat endpoint would decode (template, special tokens and tokenization all read from the
head's file) is, token for token, what llama-cpp-python's `Llama.create_chat_completion` decodes.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path

from plain_llama import plain_llama
from tiny_models import write_tiny_model

from kafila.runtime.engine.local_ring import open_engine
from kafila.runtime.llama.model import ContextSettings
from kafila.serving.chat_template import ChatTemplate

HARMONY = (Path(__file__).parent / "fixtures" / "openai-gpt-oss-120b.jinja").read_text()
SETTINGS = ContextSettings(n_ctx=1024, n_batch=64, n_seq_max=1, n_threads=2)
MESSAGES = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "the model is in a block"},
]


def harmony_text(today: date) -> str:
    """The harmony prompt for MESSAGES, by hand: the template's system block, the system message
    as the developer's instructions, the earlier answer in the final channel, then the model's turn."""
    system = (
        "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
        f"Current date: {today:%Y-%m-%d}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    )
    return (
        f"<|start|>system<|message|>{system}<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in one word.\n\n<|end|>"
        "<|start|>user<|message|>hello world<|end|>"
        "<|start|>assistant<|channel|>final<|message|>hello<|end|>"
        "<|start|>user<|message|>the model is in a block<|end|>"
        "<|start|>assistant"
    )


def test_gpt_oss_harmony_template_renders_as_llama_cpp_python_does(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "gpt-oss.gguf", "gpt-oss", n_blocks=4, chat_template=HARMONY)
    engine = open_engine(model, [2, 2], SETTINGS, cache_dir=tmp_path / "stages")
    try:
        template = ChatTemplate(engine.chat_template(), *engine.special_text(), "gpt-oss")
        assert template.source == "the model's own (GGUF tokenizer.chat_template)"
        for _ in range(2):  # the template writes today's date: render again if midnight passed meanwhile
            before = date.today()
            rendered = template.render(MESSAGES)
            ours = engine.tokenize(rendered.text, not rendered.starts_with_bos, True)  # as the chat endpoint does
            start = engine.tokenize("<|start|>", False, True)
            theirs = llama_cpp_python_prompt(model)
            if date.today() == before:
                break
    finally:
        engine.close()
    assert rendered.text == harmony_text(before)
    assert not rendered.starts_with_bos  # gpt-oss adds no BOS, and harmony writes none
    assert ours == theirs
    assert len(start) == 1 and ours.count(start[0]) == 6  # the markers are single special tokens


def llama_cpp_python_prompt(model: Path) -> list[int]:
    """The tokens `Llama.create_chat_completion` evaluates for MESSAGES with the GGUF's template."""
    llama = plain_llama(str(model), n_ctx=SETTINGS.n_ctx, n_threads=2, verbose=False)
    try:
        reply = llama.create_chat_completion(MESSAGES, max_tokens=1, temperature=0.0)  # type: ignore[arg-type]
        n_prompt = reply["usage"]["prompt_tokens"]  # type: ignore[index]
        return [int(token) for token in llama.input_ids[:n_prompt]]
    finally:
        llama.close()


def test_a_gpt_oss_without_a_template_gets_llama_cpp_s_built_in_harmony() -> None:
    rendered = ChatTemplate(None, "", "", "gpt-oss").render(MESSAGES[1:2])
    assert rendered.text == "<|start|>user<|message|>hello world<|end|><|start|>assistant"
