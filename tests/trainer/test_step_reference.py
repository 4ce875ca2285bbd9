"""The DP step computes what it computed before it was reworked for GPU speed.

`reference/step_reference.pt` was recorded with the code before the rework (see
`reference/make_step_reference.py`): per-unit norms and clipped sums of `GhostClipper.backward`, and the
noiseless gradients two DPTrainer steps hand to the optimizer, with ε and the clipping norm reached. The
adaptive-clipping trainer case was re-recorded when the scalar releases' sampler changed (draws reaching 14.85σ):
its first step still matches the old recording exactly; its C after a step follows the new noised count.

The tolerances are float32 rounding (the models run in float32) and the accountant's last digits: the libraries
resolved on 2026-12-03 moved the clipped sums by up to 4e-8 of their largest entry and ε by up to 6e-9 relative,
with the same hf_dp code.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from step_cases import CLIPPER_CASES, TRAINER_CASES, clipper_case, trainer_case

REFERENCE = torch.load(Path(__file__).with_name("reference") / "step_reference.pt")


@pytest.mark.parametrize("name", sorted(CLIPPER_CASES))
def test_clipper_matches_reference(name):
    expected, actual = REFERENCE["clipper"][name], clipper_case(name)
    torch.testing.assert_close(actual["norms"], expected["norms"], rtol=1e-6, atol=1e-9)
    assert actual["grads"].keys() == expected["grads"].keys()
    scale = max(float(grad.abs().max()) for grad in expected["grads"].values())  # (a key bias's gradient is ~0)
    for param, grad in expected["grads"].items():
        torch.testing.assert_close(actual["grads"][param], grad, rtol=1e-6, atol=1e-6 * scale, msg=param)


@pytest.mark.parametrize("name", sorted(TRAINER_CASES))
def test_trainer_step_matches_reference(tmp_path, name):
    expected, actual = REFERENCE["trainer"][name], trainer_case(name, tmp_path)
    assert actual["epsilon"] == pytest.approx(expected["epsilon"], rel=1e-7)
    assert actual["max_grad_norm"] == pytest.approx(expected["max_grad_norm"], rel=1e-6)
    assert len(actual["grads"]) == len(expected["grads"]) == 2
    for step_actual, step_expected in zip(actual["grads"], expected["grads"]):
        for param, grad in step_expected.items():
            torch.testing.assert_close(step_actual[param], grad, rtol=1e-5, atol=1e-8, msg=param)
