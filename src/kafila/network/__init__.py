"""Network: the activation frame protocol, and later rendezvous, NAT classification and QUIC links."""
