"""Output gradients the book-keeping sum may overwrite: only the step's own, never a tensor anything else holds.

A dropped unit (weight 0) is masked out of both factors of each product; a factor that is one of the backward's
output gradients, held by nothing else (`mark_scratch`), is masked in place instead of copied. Checked here: which
factors are flagged (an aliased, an expanded or a forward tensor never is), that tensors a user holds are left as
they were, and that the sums equal those of the run where the dropped unit's loss is multiplied by 0.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_dp.clipping import GhostClipper, clip
from hf_dp.clipping.accumulate import ClippedGrads
from hf_dp.clipping.terms import OuterGrad
from trainer_fixtures import tiny_llama

C = 0.5


@pytest.fixture
def flags(monkeypatch):
    """The `scratch` flags `mark_scratch` set, as (parameter shape, left flag, right flag), per backward."""
    seen = []
    original = clip.mark_scratch

    def spy(terms_by_param, output_grads, held):
        original(terms_by_param, output_grads, held)
        seen.extend((tuple(param.shape), *term.scratch) for param, terms in terms_by_param.items()
                    for term in terms if isinstance(term, OuterGrad))

    monkeypatch.setattr(clip, "mark_scratch", spy)
    return seen


class TwoBranches(nn.Module):
    """`a(x) + b(x)`: autograd hands both layers the very same output gradient (aliased: never scratch), and a
    head whose output is summed straight into the loss (an expanded, stride-0 gradient: never scratch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 5) -> (B,)
        hidden = torch.tanh(self.a(x) + self.b(x))
        return self.head(hidden).sum(dim=(1, 2))


def _sums(model, inputs, losses_of):
    clipper = GhostClipper(model)
    model.zero_grad(set_to_none=True)
    norms = clipper.backward(losses_of(model(inputs)), max_grad_norm=C)
    clipper.detach()
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]), norms


def test_llama_output_gradients_are_scratch_and_inputs_are_not(flags):
    model = tiny_llama(seed=1)
    ids = torch.randint(0, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    GhostClipper(model).backward(model(input_ids=ids, use_cache=False).logits.logsumexp(-1).mean(-1),
                                 max_grad_norm=C)
    dense = [flag for flag in flags if flag[0] != (model.config.vocab_size, model.config.hidden_size)
             or flag[1]]  # the tied/input embedding's left factor is its token ids
    assert dense and all(left and not right for _, left, right in dense)  # nn.Linear: output gradient on the left


def test_aliased_and_expanded_gradients_are_never_scratch(flags):
    model = TwoBranches()
    _sums(model, torch.randn(3, 2, 5), lambda out: out)
    assert len(flags) == 3 and not any(left or right for _, left, right in flags)


@pytest.mark.parametrize("model_of", [TwoBranches, lambda: tiny_llama(seed=1)], ids=["aliased", "llama"])
def test_a_dropped_unit_adds_zero_and_held_tensors_keep_their_values(model_of):
    """Example 1's loss is inf: the sums equal the run with its loss times 0, and the inputs and hidden states the
    caller holds are unchanged (only the step's own output gradients may be written)."""
    llama = model_of is not TwoBranches

    def run(poison):
        model = model_of()
        clipper = GhostClipper(model)
        if llama:
            ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
            inputs = model.get_input_embeddings()(ids).detach()
            outputs = model(inputs_embeds=inputs, use_cache=False, output_hidden_states=True)
            losses, states = outputs.logits.logsumexp(-1).mean(-1), outputs.hidden_states
        else:
            inputs = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(0))
            losses, states = model(inputs), ()
        held = [tensor.detach().clone() for tensor in (inputs, *states)]
        losses = losses + torch.tensor([0, math.inf, 0]) if poison else losses * torch.tensor([1.0, 0, 1])
        norms = clipper.backward(losses, max_grad_norm=C)
        clipper.detach()
        assert all(torch.equal(tensor.detach(), copy) for tensor, copy in zip((inputs, *states), held))
        return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None]), norms

    (poisoned, norms), (reference, _) = run(poison=True), run(poison=False)
    assert torch.isfinite(poisoned).all() and math.isinf(norms[1]) and torch.isfinite(norms[[0, 2]]).all()
    torch.testing.assert_close(poisoned, reference, rtol=1e-6, atol=1e-9)


def test_a_bf16_model_with_an_inf_unit_moves_the_float32_sums_by_at_most_c():
    """bf16 parameters (factors copied to float32, weighted and masked in those copies): the poisoned unit adds
    exactly nothing, and the same unit with a finite loss moves the float32 sums by at most C."""
    def sums(scale):
        model = tiny_llama(seed=1).to(torch.bfloat16)
        clipper, into = GhostClipper(model), ClippedGrads()
        ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
        losses = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean(-1)
        clipper.backward(losses * scale, max_grad_norm=C, into=into)
        clipper.detach()
        grads = into.grads(list(model.parameters()))
        assert all(grad.dtype == torch.float32 for grad in grads)  # the sums of bf16 parameters, before any rounding
        return torch.cat([grad.double().flatten() for grad in grads])

    poisoned, without, honest = (sums(torch.tensor(scale)) for scale in ([1.0, math.inf, 1], [1.0, 0, 1], [1.0, 1, 1]))
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, without, rtol=1e-6, atol=1e-9)
    assert float((honest - without).norm()) <= C * (1 + 1e-5)
