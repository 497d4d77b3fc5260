"""Runtime: GGUF files and, later, llama.cpp stages."""
