"""Stages and the engines over them: frames of hidden states in, hidden states or logits out;
sampling and log probabilities; a ring of stages in local processes or over links."""
