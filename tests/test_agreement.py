"""The tolerance check of a mixed-kernel ring against the unsplit model.

First the pure statistics, on arrays made here; then real llama.cpp: a 2-stage ring whose first
stage runs flash attention off and whose head runs it on, against the unsplit model with it on,
is within tolerance and agrees on every top token but near-ties, while the same ring with one
norm weight of its first stage scaled by 1.1 is flagged.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_tiny_model

from kafila.runtime.engine.agreement import (
    AgreementReport,
    CutError,
    ErrorSpread,
    Tolerance,
    TopTokenAgreement,
    first_divergence,
    relative_errors,
    spread,
    top_token_agreement,
)
from kafila.runtime.engine.agreement_ring import compare_ring, perturbed_copy
from kafila.runtime.engine.stage import WholeModel
from kafila.runtime.gguf.slicer import slice_model
from kafila.runtime.llama.model import ContextSettings

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SETTINGS = ContextSettings(n_ctx=256, n_batch=16, n_seq_max=1, n_threads=2)
PROMPT = "hello world, the kafila model is in a block of the world and it is to the model of the world"
GEMMA_TURN = "<start_of_turn>user\nWrite a short story about a lighthouse keeper.<end_of_turn>\n<start_of_turn>model\n"


def test_relative_errors_are_per_row_norms() -> None:
    unsplit = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    ring = np.array([[3.0, 4.5], [1.0, 0.0], [0.0, 0.25]])
    assert relative_errors(ring, unsplit).tolist() == [0.1, 0.0, 0.25]  # a zero row is measured against 1
    assert relative_errors(np.array([2.0, 0.0]), np.array([1.0, 0.0])).tolist() == [1.0]  # one row as a vector
    with pytest.raises(ValueError, match="shape"):
        relative_errors(ring, unsplit[:2])


def test_spread_takes_max_and_median() -> None:
    assert spread(np.array([0.1, 0.3, 0.2, 0.0])) == ErrorSpread(rows=4, max=0.3, median=pytest.approx(0.15))
    with pytest.raises(ValueError, match="no rows"):
        spread(np.array([]))


def test_top_tokens_agree_or_part_at_a_near_tie_or_beyond() -> None:
    # Rows of 4 logits whose standard deviation is 1 (values +-1), but for the gaps set below.
    unsplit = np.array(
        [
            [1.0, -1.0, -1.0, 1.0 - 1e-3],  # tokens 0 and 3 within a near-tie (std ~1, margin 0.1)
            [1.0, -1.0, -1.0, 0.5],  # token 0 well ahead of 3
            [-1.0, 1.0, -1.0, -1.0],
        ]
    )
    ring = np.array([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    result = top_token_agreement(ring, unsplit, margin=0.1)
    assert result == TopTokenAgreement(positions=3, agreeing=1, near_ties=(0,), disagreements=(1,))
    assert result.fraction == pytest.approx(1 / 3)
    assert top_token_agreement(ring, unsplit, margin=1.0).disagreements == ()  # 0.5 apart is within 1 std
    with pytest.raises(ValueError, match="positions, vocabulary"):
        top_token_agreement(ring[0], unsplit[0], margin=0.1)


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a run ending early parts where it ends
    assert first_divergence([], []) is None


def _report(hidden: float, logits: float, disagreements: tuple[int, ...]) -> AgreementReport:
    return AgreementReport(
        cuts=(CutError(after_block=3, spread=ErrorSpread(10, hidden, hidden / 2)),),
        logits=ErrorSpread(8, logits, logits / 2),
        top_tokens=TopTokenAgreement(8, 8 - 1 - len(disagreements), (5,), disagreements),
        free_run_tokens=8,
        free_run_divergence=5,
    )


def test_problems_name_each_bound_crossed_and_near_ties_pass() -> None:
    tolerance = Tolerance(hidden_relative_error=0.1, logit_relative_error=0.2, disagreements=0)
    assert _report(0.1, 0.2, ()).problems(tolerance) == []  # a near-tie and a parted free run do not fail
    problems = _report(0.15, 0.3, (2, 6)).problems(tolerance)
    assert problems == [
        "hidden states after block 3: relative error up to 0.15 (tolerance 0.1)",
        "logits: relative error up to 0.3 (tolerance 0.2)",
        "top tokens differ beyond a near-tie at 2 of 8 positions (first at 2; 0 allowed)",
    ]
    assert _report(float("nan"), 0.0, ()).problems(tolerance)[0].startswith("hidden states after block 3")
    assert _report(0.0, 0.0, (2,)).problems(replace(tolerance, disagreements=1)) == []
    assert "the texts part at token 5" in _report(0.0, 0.0, ()).lines()[-1]


def _tiny_ring(tmp_path: Path, arch: str = "llama") -> tuple[Path, list[Path], list[int]]:
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_blocks=4)
    whole = WholeModel(path, SETTINGS)
    prompt = whole.vocabulary.tokenize(PROMPT)
    whole.close()
    files = [stage.path for stage in slice_model(path, [2, 2], tmp_path / "stages")]
    return path, files, prompt


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_ring_mixing_flash_attention_is_within_tolerance(tmp_path: Path, arch: str) -> None:
    """Random tiny weights make flat logits: the median gap between the top two is 0.2 to 0.5 of
    their standard deviation. Where it is 0.2 (tiny qwen2, qwen3, phi3), flash attention off in one
    stage flips a few tokens, one or two beyond 0.1 standard deviation: those families are left to
    the real model below, whose candidates stand further apart."""
    path, files, prompt = _tiny_ring(tmp_path, arch)
    off, on = replace(SETTINGS, flash_attn=False), replace(SETTINGS, flash_attn=True)
    report = compare_ring(path, on, [(files[0], off), (files[1], on)], prompt, steps=48)
    assert report.problems(Tolerance()) == [], report.lines()
    assert report.cuts[0].after_block == 1 and report.cuts[0].spread.rows == len(prompt) + 47
    assert report.logits.rows == 48 and report.top_tokens.positions == 48
    assert report.cuts[0].spread.max > 0  # the kernels differ: this is not the bit-equal case
    assert report.top_tokens.fraction >= 0.95

    same = compare_ring(path, on, [(files[0], on), (files[1], on)], prompt, steps=16)
    assert same.cuts[0].spread.max == 0 and same.logits.max == 0  # the same kernels: bit-equal
    assert same.free_run_divergence is None


def test_a_ring_with_a_wrong_weight_is_flagged(tmp_path: Path) -> None:
    path, files, prompt = _tiny_ring(tmp_path)
    bad = perturbed_copy(files[0], "blk.1.attn_norm.weight", 1.1, tmp_path / "bad.gguf")
    report = compare_ring(path, SETTINGS, [(bad, SETTINGS), (files[1], SETTINGS)], prompt, steps=48)
    problems = report.problems(Tolerance())
    assert [problem.split(" ")[0] for problem in problems] == ["hidden", "logits:", "top"], report.lines()
    assert problems[0].startswith("hidden states after block 1: relative error up to")
    assert problems[2].startswith("top tokens differ beyond a near-tie")
    with pytest.raises(ValueError, match=r"no float32 tensor blk\.0\.attn_q\.weight"):
        perturbed_copy(files[0], "blk.0.attn_q.weight", 1.1, tmp_path / "q.gguf")


def test_the_real_model_mixing_flash_attention_is_within_tolerance(gemma_path: Path, tmp_path: Path) -> None:
    """gemma-3-270m cut 9 + 9, flash attention off in the first stage: within tolerance; with one
    norm weight of its first stage scaled, out of it."""
    settings = replace(SETTINGS, n_ctx=512, n_batch=64)
    whole = WholeModel(gemma_path, settings)
    prompt = whole.vocabulary.tokenize(GEMMA_TURN, parse_special=True)
    whole.close()
    files = [stage.path for stage in slice_model(gemma_path, [9, 9], tmp_path)]
    off, on = replace(settings, flash_attn=False), replace(settings, flash_attn=True)
    report = compare_ring(gemma_path, on, [(files[0], off), (files[1], on)], prompt, steps=24)
    assert report.problems(Tolerance()) == [], report.lines()
    assert report.cuts[0].spread.max > 0

    # On this model flash attention off moves the states about as much as one block's FFN output
    # scaled by 1.1 (2% at the cut, 5% in the logits): the control scales it by 1.5.
    bad = perturbed_copy(files[0], "blk.8.post_ffw_norm.weight", 1.5, tmp_path / "bad.gguf")
    flagged = compare_ring(gemma_path, on, [(bad, on), (files[1], on)], prompt, steps=8)
    problems = flagged.problems(Tolerance())
    assert [problem.split(" ")[0] for problem in problems] == ["hidden", "logits:"], flagged.lines()


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPTS / "backend_agreement.py"), "--tiny", "--threads", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def test_the_script_passes_a_mixed_ring_fails_a_wrong_one_and_refuses_bad_input() -> None:
    """scripts/backend_agreement.py, as the device check runs it: 0 within tolerance, 1 out of it,
    2 and one line for input it cannot take."""
    within = _script("--flash-attn", "off,on", "--steps", "16")
    assert within.returncode == 0, within.stdout + within.stderr
    assert "WITHIN tolerance" in within.stdout and "stages: cpu/flash-attn off, cpu/flash-attn on" in within.stdout
    out = _script("--steps", "16", "--perturb", "blk.1.attn_norm.weight=1.1")
    assert out.returncode == 1 and "OUT OF tolerance" in out.stdout, out.stdout + out.stderr
    for bad, said in [
        (["--flash-attn", "on,of"], "--flash-attn takes 2 of on/off/auto, comma-separated, not 'on,of'"),
        (["--perturb", "nope=2"], "--perturb nope=2: the first stage has no float32 tensor nope"),
        (["--split", "3,3"], "blocks"),
    ]:
        refused = _script(*bad)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("backend_agreement: ") and said in refused.stderr
