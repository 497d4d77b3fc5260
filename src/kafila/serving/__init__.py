"""Requests on an engine: continuous batching in waves (`batcher`), the thread that owns the
engine (`engine_loop`), chat templates, and text that holds back what may become a stop string.
Pure but for `engine_loop`; it imports the runtime's engine and the wire, never the network."""
