"""Command line: thin wrappers that read files, call a pure core, and print."""
