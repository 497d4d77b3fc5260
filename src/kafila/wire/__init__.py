"""What crosses the wire between machines, defined once and imported by both ends: activation
and file frames (`frames`), and the host's and members' control messages (`control`).

A leaf: it imports only `contracts` and the shared leaves, so the network, the runtime and the
session can all speak it without leaning on each other.
"""
