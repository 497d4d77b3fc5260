"""The OpenAI-compatible HTTP API on the host: schemas, chat templates, continuous batching, the server."""
