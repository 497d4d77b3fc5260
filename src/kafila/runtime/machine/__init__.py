"""This machine: what it can do (`kafila probe`, a model's own prices) and its own local plan."""
