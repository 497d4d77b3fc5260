"""A member that cannot allocate the stage the host planned for it: a real `kafila join` whose
process may not grow its writable memory (RLIMIT_DATA) by as much as two blocks' KV cache, so
llama.cpp's allocation of a larger share really fails. The host plans again with less of that
member's memory until its share loads, and serves with it holding fewer blocks. The same for the
host's own share: a real `kafila host` so limited plans again with less of its own memory.

RLIMIT_DATA rather than RLIMIT_AS: the address space also counts reservations glibc makes per
thread (64 MiB arenas) and never fills, so where it stands when llama.cpp allocates varies by
more than a block; writable memory does not. The room is chosen so that a share of two blocks
fails at its KV cache, the first and largest allocation of a context: llama.cpp fails that
cleanly, but asserts (and aborts) where a later, small allocation fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import openai
from host_process import running_host, stop, until_status
from serving_checks import unsplit_greedy
from test_session_network import share_this_machines_probe
from tiny_models import Q8_0, ModelShape, write_tiny_model

from kafila.contracts import FleetDevice
from kafila.runtime.gguf.manifest import read_manifest
from kafila.runtime.gguf.slicer import cached_slices
from kafila.runtime.llama.errors import out_of_memory

# 384 MiB of KV cache a block at 12288 tokens × 4 requests (8 KiB a token: 8 KV heads of 256, f16),
# against 4 MB of weights: what a stage needs is its cache.
SHAPE = ModelShape(
    n_embd=512, n_head=8, n_head_kv=8, head_dim=256, n_ff=1024, tied_output=False, embd_std=1.0,
    ffn_types=(Q8_0,), attn_v_type=Q8_0,
)  # fmt: skip
CONTEXT, CONCURRENCY = 12288, 4
PROMPT = "the quick brown fox"

# What loading a stage adds to a fresh process's writable memory (VmData), once llama.cpp is loaded.
MEASURE_LOAD = """
import sys
from kafila.runtime.llama.model import ContextSettings
from kafila.runtime.llama.loading import llama
from kafila.runtime.engine.stage import BlockStage, HeadStage

def data():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))

llama()
settings = ContextSettings(n_ctx=int(sys.argv[1]), n_batch=512, n_seq_max=int(sys.argv[2]), n_threads=1)
before = data()
stage = (HeadStage if sys.argv[4] == "head" else BlockStage)(sys.argv[3], settings)
print(data() - before)
"""

# `kafila`, in a process whose writable memory may grow by at most argv[1] bytes past what it holds
# once kafila (the session and the API among it) and llama.cpp are loaded: larger allocations fail
# as on a machine short of memory.
LIMITED_KAFILA = """
import resource, sys
import kafila.api.server, kafila.session.runner, uvicorn
from kafila.cli.app import main
from kafila.runtime.llama.loading import llama

llama()
data = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))
limit = data + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
sys.argv = ["kafila", *sys.argv[2:]]
main()
"""


def room_for_one_block(model: Path, cache: Path, head: bool = False) -> int:
    """Bytes past its start that let a process load a stage of one block (the head's, with
    `head`), but not allocate the KV cache of two: halfway between what a one-block stage adds
    (measured here, allocator and all) and two blocks' cache (the manifest's figure)."""
    stages = cached_slices(model, [3, 1] if head else [1, 3], cache)
    stage = stages[1] if head else stages[0]
    command = [
        sys.executable, "-c", MEASURE_LOAD, str(CONTEXT * CONCURRENCY), str(CONCURRENCY), str(stage.path),
        "head" if head else "block",
    ]  # fmt: skip
    one = int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    caches = 2 * read_manifest(model).kv_bytes_per_token[0] * CONTEXT * CONCURRENCY
    assert caches - one > 200 * 2**20, (one, caches)  # a window wide enough for what a member's links add
    return (one + caches) // 2


def faster(probe: Path, times: float) -> None:
    """This machine's probe, with its memory read `times` as fast: the planner gives it more blocks."""
    cached = json.loads(probe.read_text())
    device = FleetDevice.model_validate(cached["device"])
    assert device.bandwidth_gb_s is not None
    update = {"bandwidth_gb_s": device.bandwidth_gb_s * times}
    if device.head_bandwidth_gb_s is not None:
        update["head_bandwidth_gb_s"] = device.head_bandwidth_gb_s * times
    probe.write_text(json.dumps({**cached, "device": device.model_copy(update=update).model_dump()}))


def test_a_member_that_runs_out_of_memory_loading_its_share_serves_a_smaller_one(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "kv-heavy.gguf", "llama", n_blocks=4, shape=SHAPE)
    room = room_for_one_block(model, tmp_path / "measured")
    share_this_machines_probe(tmp_path, 2)  # cache-1 is the host's
    faster(tmp_path / "cache-0" / "probe.json", 10)  # so the member is planned most of the blocks
    args = ("--model", model, "--members", "2", "--context", str(CONTEXT), "--concurrency", str(CONCURRENCY),
            "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")  # fmt: skip
    member: subprocess.Popen[str] | None = None
    said, failed = "", False
    with running_host(*args, ready=False, env={"KAFILA_CACHE": str(tmp_path / "cache-1")}) as host:
        try:
            code, rendezvous = host.join_line()
            command = [sys.executable, "-c", LIMITED_KAFILA, str(room), "join", code, "--rendezvous", rendezvous,
                       "--name", "short-member", "--threads", "1"]  # fmt: skip
            env = {**os.environ, "KAFILA_CACHE": str(tmp_path / "cache-0"), "COLUMNS": "200"}
            member = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            status = until_status(host, lambda s: bool(s.get("ready")), "serving", 180)
            output = host.output()
            ran_out = re.findall(r"short-member ran out of memory loading blocks (\d+)-(\d+) \(needed", output)
            assert ran_out, output  # llama.cpp's allocation really failed, at least once
            first, end = map(int, ran_out[0])
            held = next(m["blocks"] for m in status["members"] if m["name"] == "short-member")
            assert 1 <= held[1] - held[0] < end - first + 1, (ran_out, status)  # a smaller share, still one
            assert len(ran_out) == output.count("GiB for it"), output  # each time, replanned with less of it
            assert "leaving a member out" not in output, output
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
            result = client.completions.create(model="kv-heavy", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
        except BaseException:
            failed = True
            raise
        finally:
            said = stop(member) if member is not None else ""
            if failed:
                print(f"--- short-member said:\n{said}", file=sys.stderr)
    assert said.count("failed to allocate buffer for kv cache") == len(ran_out), said  # llama.cpp's own words


def test_a_host_that_runs_out_of_memory_loading_its_own_share_serves_a_smaller_one(tmp_path: Path) -> None:
    """The host, planned most of the blocks and the head, cannot allocate their cache: it plans
    again with less of its own memory until its share loads, and serves with fewer blocks."""
    model = write_tiny_model(tmp_path / "kv-heavy.gguf", "llama", n_blocks=4, shape=SHAPE)
    room = room_for_one_block(model, tmp_path / "measured", head=True)
    share_this_machines_probe(tmp_path, 2)  # cache-1 is the host's
    faster(tmp_path / "cache-1" / "probe.json", 10)  # so the host is planned most of the blocks
    args = ("--model", model, "--members", "2", "--context", str(CONTEXT), "--concurrency", str(CONCURRENCY),
            "--threads", "1", "--rendezvous-port", "0", "--stun-port", "0")  # fmt: skip
    launcher = (sys.executable, "-c", LIMITED_KAFILA, str(room))
    env = {"KAFILA_CACHE": str(tmp_path / "cache-1")}
    member: subprocess.Popen[str] | None = None
    with running_host(*args, ready=False, env=env, launcher=launcher) as host:
        try:
            code, rendezvous = host.join_line()
            command = [sys.executable, "-m", "kafila", "join", code, "--rendezvous", rendezvous,
                       "--name", "roomy-member", "--threads", "1"]  # fmt: skip
            member_env = {**os.environ, "KAFILA_CACHE": str(tmp_path / "cache-0"), "COLUMNS": "200"}
            member = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=member_env
            )
            status = until_status(host, lambda s: bool(s.get("ready")), "serving", 180)
            output = host.output()
            ran_out = re.findall(r"this machine ran out of memory loading blocks (\d+)-(\d+) \(needed", output)
            assert ran_out, output  # llama.cpp's allocation really failed, at least once
            first, end = map(int, ran_out[0])
            held = next(m["blocks"] for m in status["members"] if m["name"] != "roomy-member")
            assert 1 <= held[1] - held[0] < end - first + 1, (ran_out, status)  # a smaller share, still one
            assert "failed to allocate buffer for kv cache" in output, output  # llama.cpp's own words
            client = openai.OpenAI(base_url=f"{host.base_url}/v1", api_key="none", max_retries=0, timeout=120)
            result = client.completions.create(model="kv-heavy", prompt=PROMPT, max_tokens=8, temperature=0)
            assert result.choices[0].text == unsplit_greedy(model, PROMPT, 8)
        finally:
            if member is not None:
                stop(member)


def test_llama_cpps_allocation_failures_read_as_out_of_memory_and_others_do_not() -> None:
    failed_kv = (
        "llama.cpp could not create a context for stage.gguf: ggml_backend_cpu_buffer_type_alloc_buffer: failed to "
        "allocate buffer of size 536870912; llama_init_from_model: failed to initialize the context: failed to "
        "allocate buffer for kv cache"
    )
    assert out_of_memory(RuntimeError(failed_kv))
    cuda = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 812.00 MiB on device 0: cudaMalloc failed"
    assert out_of_memory(RuntimeError(f"{cuda}: out of memory"))
    assert out_of_memory(MemoryError())
    assert not out_of_memory(
        RuntimeError("llama.cpp could not load stage.gguf: tensor 'blk.1.attn_q.weight' not found")
    )
    assert not out_of_memory(ValueError("stage file abc is not in the cache"))
