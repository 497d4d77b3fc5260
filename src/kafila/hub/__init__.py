"""Models by name on a Hugging Face hub: `org/repo:QUANT` resolved to one GGUF file, downloaded by the host."""
