"""Network: activation frames, the rendezvous (signalling, STUN, relay), NAT classification,
hole punching, mutually pinned QUIC links (direct or relayed), the trust exchange on the session
code, and stage-file transfer."""
