"""Writes `step_reference.pt`: what one DP step computed before the DP step was reworked for GPU speed.

Recorded once, with the code of that time, so that `tests/trainer/test_step_reference.py` can check that the
rework changed nothing in what is computed:

- `clipper`: `GhostClipper.backward` on tiny GPT-2 (tied embeddings), Llama and BERT models, full and LoRA, with
  one unit per example, units of several examples (not contiguous) and packed rows: the per-unit norms and the
  clipped gradient sums (`.grad` after the call; no noise);
- `trainer`: two DPTrainer steps (ULS, ELS, example-level; fixed and adaptive C) with the gradient noise switched
  off: the gradients handed to the optimizer (clipped sums divided by the expected batch size) and ε.

Run from the repository root: `python tests/trainer/reference/make_step_reference.py`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(TESTS), str(TESTS / "trainer")]

from step_cases import CLIPPER_CASES, TRAINER_CASES, clipper_case, trainer_case  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    reference = {"clipper": {}, "trainer": {}}
    for name in CLIPPER_CASES:
        reference["clipper"][name] = clipper_case(name)
    for name in TRAINER_CASES:
        reference["trainer"][name] = trainer_case(name, Path("/tmp/step-reference") / name)
    torch.save(reference, Path(__file__).with_name("step_reference.pt"))


if __name__ == "__main__":
    main()
