"""llama.cpp through its C API: loading, contexts and batches; its devices, CPU features,
threads and memory; what a dead child said last."""
