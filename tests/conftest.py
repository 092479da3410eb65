"""Shared fixtures. Inputs are drawn fresh each run; the seed is printed in the header and can be
replayed with COLIBRI_TEST_SEED=<seed>."""
import os

import numpy as np
import pytest

SEED = int(os.environ.get("COLIBRI_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)


def pytest_report_header(config):
    return f"colibri random seed: {SEED} (replay with COLIBRI_TEST_SEED={SEED})"


@pytest.fixture
def rng(request):
    # One stream per test, derived from the run's seed and the test's id, so a failure replays alone.
    return np.random.default_rng([SEED, *request.node.nodeid.encode()])
