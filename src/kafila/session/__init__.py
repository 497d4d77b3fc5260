"""A session across machines: `kafila host` and `kafila join`, over the rendezvous and QUIC links.

The host: `core` decides, pure, in the vocabulary of `lifecycle`; `event_shell` feeds it what
happens and carries out what it decides; `runner` wires the two to the world, with
`host_engines` (the engine of each ring), `host` (the session at the rendezvous: roster,
pricing, planning), `admissions` (who gets in), `deployer` (a plan put in place), `pricing`,
`availability` (what the API may serve) and `host_status`. The member: `member_runner` (its whole
time in a session) and `member` (following its host). Both: `router` (one link's channels),
`quic_ring` (the host's engine over links), `presence` (what a machine brings), and
`local_members` (the demo's member processes).
"""
