"""benchmarks/clipping_snr.py: its statistics on synthetic per-unit gradients whose answers are known (no model)."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "clipping_snr.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("clipping_snr", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_of_identical_and_orthogonal_units(script):
    same = np.tile(np.array([[0.6, 0.8, 0.0]]), (5, 1))
    assert script.agreement(same)["mean_pairwise_cosine"] == pytest.approx(1.0)
    assert script.agreement(same)["mean_direction_norm"] == pytest.approx(1.0)
    orthogonal = np.eye(4)
    assert script.agreement(orthogonal)["mean_pairwise_cosine"] == pytest.approx(0.0, abs=1e-12)
    assert script.agreement(orthogonal)["mean_direction_norm"] == pytest.approx(0.5)


def test_clip_profile_matches_the_formula(script):
    """Two units, ĝ orthogonal, norms 1 and 3: at C = 2 the clipped mean / C is (1/2 e1 + e2)/2."""
    grads = np.array([[1.0, 0.0], [0.0, 3.0]])
    norms = np.linalg.norm(grads, axis=1)
    profile = script.clip_profile(grads, norms, {"C = 2": 2.0, "no clipping": 3.0}, sigma=1.0, batch=4.0)
    limit = math.sqrt(0.5)  # |mean ĝ| = |(e1 + e2)/2|
    assert profile["C->0"]["snr"] == pytest.approx(4.0 * limit / math.sqrt(2))
    assert profile["C = 2"]["snr_ratio"] == pytest.approx(math.hypot(0.25, 0.5) / limit)
    assert profile["C = 2"]["clipped_fraction"] == pytest.approx(0.5)
    assert profile["no clipping"]["cos_to_mean_gradient"] == pytest.approx(1.0)
    assert profile["no clipping"]["snr_ratio"] == pytest.approx(math.hypot(1 / 6, 1 / 2) / limit)


def test_same_direction_units_lose_snr_only_once_c_passes_their_norms(script):
    rng = np.random.default_rng(0)
    norms = rng.uniform(1.0, 10.0, 50)
    grads = norms[:, None] * np.array([[1.0, 0.0, 0.0]])
    profile = script.clip_profile(grads, norms, {"below": 0.5, "median": float(np.median(norms))}, 1.0, 8.0)
    assert profile["below"]["snr_ratio"] == pytest.approx(1.0)
    assert profile["median"]["snr_ratio"] < 0.9


def test_adaptive_trajectory_reaches_the_median(script):
    norms = np.random.default_rng(1).lognormal(mean=math.log(18.0), sigma=0.3, size=800)
    path = script.adaptive_trajectory(norms, initial=1.0, steps=200, batch=32, count_noise=1.6,
                                      rng=np.random.default_rng(2))
    assert path[0] == 1.0 and path[10] < 3.0  # at most exp(0.2 · 0.5) a step from C_0 = 1
    assert abs(math.log(np.median(path[100:]) / np.median(norms))) < 0.15
