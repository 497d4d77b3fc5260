"""A session across machines: `kafila host` and `kafila join`, over the rendezvous and QUIC links.

`protocol` is the pure control vocabulary between the host and its members; `router` splits one
link's frames into control, file and activation traffic; `quic_ring` lets the host's blocking
engine drive activations over links; `member` and `host` are the two sides' orchestration;
`runner` is the host's lifecycle around its HTTP server (load or gather, serve, replan, stop).
"""
