"""Network: activation frames, the rendezvous (signalling, STUN, relay), NAT classification and
hole punching. QUIC ring links come next."""
