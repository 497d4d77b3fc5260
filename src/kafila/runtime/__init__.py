"""The model on this machine: what a stage file is, how llama.cpp loads and runs it, and what
this machine can do.

- `gguf`: the GGUF format: reading headers fast, a model's manifest for the planner, slicing a
  model into stage files, per-family facts, the stage-file cache;
- `llama`: the only layer over llama.cpp's C API (loading, contexts, batches), its devices and
  backends, CPU features, threads and memory as llama.cpp sees them;
- `machine`: measuring this machine (`kafila probe`, the model's own prices) and planning its
  own local stages;
- `engine`: stages that turn frames of hidden states into hidden states or logits, samplers and
  log probabilities, and the engines that drive a ring of stages (local processes or links).

Requests, batching and text live above, in `kafila.serving`.
"""
