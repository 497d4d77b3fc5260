"""Requests on an engine: continuous batching in waves (`batcher`), the thread that owns the
engine (`engine_loop`), chat templates, text that holds back what may become a stop string, and
the handle a front end serves a ring through (`handle`: the chat template built for the model,
submit, cancel, counts). Pure but for `engine_loop`; it imports the runtime's engine and the
wire, never the network."""
