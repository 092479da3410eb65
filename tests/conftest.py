"""Shared fixtures. Inputs are drawn fresh each run; the seed is printed in the header and can be
replayed with COLIBRI_TEST_SEED=<seed>."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import colibri
from colibri.testing.generation import FAMILIES as GENERATE_FAMILIES

SEED = int(os.environ.get("COLIBRI_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)


def pytest_report_header(config):
    return f"colibri random seed: {SEED} (replay with COLIBRI_TEST_SEED={SEED})"


@pytest.fixture
def rng(request):
    # One stream per test, derived from the run's seed and the test's id, so a failure replays alone.
    return np.random.default_rng([SEED, *request.node.nodeid.encode()])


@pytest.fixture
def colibri_cli():
    """Runs `python -m colibri ARGS...` from another directory, finding this colibri package."""
    package_parent = str(pathlib.Path(colibri.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                              cwd="/", env=env, timeout=120)
    return run


@pytest.fixture(scope="session")
def serving_weights(tmp_path_factory):
    """The checkpoint the shared server serves: small, so serving on the CPU stays fast."""
    from colibri import checkpoint
    path = tmp_path_factory.mktemp("weights") / "test.colibri.safetensors"
    checkpoint.write_demo(path, experts=8, top_k=2, hidden=64, intermediate=96, dtype="bf16", seed=7)
    return path


@pytest.fixture(scope="session")
def colibri_server(serving_weights, tmp_path_factory):
    """One real tritonserver serving colibri_moe for the whole session (colibri.testing.server),
    shared by the serving tests and the load-test smoke so the suite starts it once."""
    from colibri.testing.server import serving
    with serving(serving_weights, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="session")
def generate_models(tmp_path_factory):
    """family name -> the family's tiny model written, packed and given prompts with transformers' tokens
    (colibri.testing.generation.prepare), each made once for the session, whichever tests ask for it."""
    made = {}

    def model(name):
        if name not in made:
            from colibri.testing.generation import prepare
            made[name] = prepare(name, tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}_packed"), SEED)
        return made[name]
    return model


@pytest.fixture(params=sorted(GENERATE_FAMILIES))
def family(request, generate_models):
    """Each family of colibri.testing.generation, as generate_models makes it (test_generate, test_batching;
    a test's own parametrize of "family" takes precedence)."""
    return generate_models(request.param)


@pytest.fixture
def qwen(generate_models):
    """The qwen3_moe model of generate_models."""
    return generate_models("qwen3_moe")
