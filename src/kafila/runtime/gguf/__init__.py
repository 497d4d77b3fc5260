"""The GGUF format: headers read fast, a model's manifest, stage files cut and cached."""
