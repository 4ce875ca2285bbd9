"""hf_dp.step: per-unit clipped sums of a micro-batch, the noise added once, and a step that reaches no parameter."""
from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_dp.batching import MicroBatch
from hf_dp.clipping import GhostClipper
from hf_dp.clipping.units import UnitIndex
from hf_dp.step import DPStep, StepSettings, check_some_gradient
from trainer_fixtures import pad_collator, tiny_bert, user_dataset

EXPECTED_BATCH = 8.0
SETTINGS = StepSettings(device=torch.device("cpu"), causal_lm=False, max_loss=5.0,
                        forward_context=contextlib.nullcontext)


def dp_step(model=None, *, expected_batch_size=EXPECTED_BATCH, noise_multiplier=0.8, seed=1, max_grad_norm=1.0):
    """A DPStep built from values only: the plan's q·N and σ are all the stages read here."""
    plan = SimpleNamespace(expected_batch_size=expected_batch_size, noise_multiplier=noise_multiplier,
                           max_grad_norm=max_grad_norm, private_logging=False)
    clipper = GhostClipper(model) if model is not None else None
    return DPStep(SimpleNamespace(plan=plan), clipper, seed, SETTINGS)


def rows(count=6):
    return [dict(row) for row in user_dataset(num_users=count, max_rows=1, seed=3)]


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


# ---- per-unit clipping -----------------------------------------------------------------------------------------------


def test_with_a_large_clipping_norm_the_sum_is_the_plain_gradient_over_the_expected_batch():
    model = tiny_bert()
    reference = copy.deepcopy(model)
    batch = pad_collator(rows())
    sums = dp_step(model).clip(model, [MicroBatch(batch, num_examples=6)], 1e6)
    losses = F.cross_entropy(reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                             batch["labels"], reduction="none")
    (losses.sum() / EXPECTED_BATCH).backward()
    torch.testing.assert_close(grads(model), grads(reference), rtol=1e-4, atol=1e-7)
    assert sums.clipped_units.item() == 0 and sums.centered_unclipped.item() == 3.0  # 6 units, none clipped
    assert sums.loss_sum.item() == pytest.approx(losses.clamp(max=5.0).sum().item(), rel=1e-5)


def test_with_a_small_clipping_norm_each_unit_adds_at_most_c():
    model = tiny_bert()
    sums = dp_step(model).clip(model, [MicroBatch(pad_collator(rows()), num_examples=6)], 1e-3)
    assert sums.clipped_units.item() == 6 and sums.centered_unclipped.item() == -3.0
    norm = grads(model).norm().item()
    assert 0 < norm <= 6 * 1e-3 / EXPECTED_BATCH * (1 + 1e-5)  # 6 clipped units of norm C, over the expected size


def test_a_user_is_one_unit_whose_gradient_is_that_of_its_mean_loss():
    """ULS: two users of 3 and 1 rows, weights 1/n_u: with a large C the sum is Σ_u ∇(mean loss of u) / m."""
    model = tiny_bert()
    reference = copy.deepcopy(model)
    batch = pad_collator(rows(4))
    weights = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0])
    micro = MicroBatch(batch, units=UnitIndex.from_counts([3, 1]), loss_weights=weights, num_examples=4)
    sums = dp_step(model).clip(model, [micro], 1e6)
    losses = F.cross_entropy(reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                             batch["labels"], reduction="none")
    ((losses * weights).sum() / EXPECTED_BATCH).backward()
    torch.testing.assert_close(grads(model), grads(reference), rtol=1e-4, atol=1e-7)
    assert sums.centered_unclipped.item() == 1.0  # 2 units, not 4 rows
    assert sums.loss_sum.item() == pytest.approx((losses * weights).clamp(max=5.0).sum().item(), rel=1e-5)
    clipped = tiny_bert()  # a small C: each user, not each row, adds at most C
    dp_step(clipped).clip(clipped, [micro], 1e-3)
    assert 0 < grads(clipped).norm().item() <= 2 * 1e-3 / EXPECTED_BATCH * (1 + 1e-5)


def test_a_micro_batch_without_labels_or_with_lost_rows_is_refused():
    model = tiny_bert()
    step = dp_step(model)
    batch = pad_collator(rows())
    with pytest.raises(ValueError, match="need 'labels'"):
        step.losses(model, MicroBatch({k: v for k, v in batch.items() if k != "labels"}))
    with pytest.raises(ValueError, match="returned 6 examples for 7 sampled rows"):
        step.losses(model, MicroBatch(batch, num_examples=7))


# ---- aggregation: the noise is added once ---------------------------------------------------------------------------


def test_aggregation_adds_noise_of_std_sigma_c_over_the_expected_batch_to_every_gradient():
    params = [torch.nn.Parameter(torch.zeros(300, 200)), torch.nn.Parameter(torch.zeros(5000))]
    params[1].grad = torch.full((5000,), 0.25)  # a clipped sum already there
    sums = SimpleNamespace(all_reduce=lambda: pytest.fail("one process: nothing to all-reduce"))
    dp_step(expected_batch_size=4.0, noise_multiplier=0.8).aggregate(params, ["w", "b"], sums, max_grad_norm=0.5,
                                                                     step=0)
    assert params[0].grad is not None  # a parameter without a gradient still gets the noise
    noise = torch.cat([params[0].grad.flatten(), params[1].grad - 0.25]).double()
    std = 0.8 * 0.5 / 4.0
    assert noise.std().item() == pytest.approx(std, rel=0.01)
    assert abs(noise.mean().item()) < 4 * std / noise.numel() ** 0.5


def test_a_step_that_reaches_no_parameter_the_optimizer_updates_stops_training():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError, match="produced no gradient for any parameter the optimizer updates"):
        check_some_gradient(params, [MicroBatch({})])
    check_some_gradient(params, [])  # an empty Poisson sample is legal
    params[0].grad = torch.zeros(3)
    check_some_gradient(params, [MicroBatch({})])
