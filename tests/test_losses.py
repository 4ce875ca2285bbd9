"""hf_dp.losses: one loss per example (classification, regression, token heads, packed rows), and causal LMs found by
their head, not their name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import BertGenerationConfig, BertGenerationDecoder, DataCollatorWithFlattening, LlamaForCausalLM, \
    LlamaForSequenceClassification

from hf_dp import DPTrainer
from hf_dp.losses import packed_example_ids, packed_per_example_loss, per_example_loss
from hf_dp.model_kind import is_causal_lm, underlying_model
from trainer_fixtures import VOCAB, TinyDecoder, make_args, tiny_bert, tiny_llama, user_dataset


# ---- causal LMs are found by their head ---------------------------------------------------------------------------


def tiny_bert_generation_decoder():
    torch.manual_seed(0)
    config = BertGenerationConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, is_decoder=True)
    return BertGenerationDecoder(config)


def test_causal_lms_are_found_by_their_head_not_their_name(tmp_path):
    llama = tiny_llama()
    assert is_causal_lm(TinyDecoder(llama.config))
    assert is_causal_lm(tiny_bert_generation_decoder())  # a transformers causal LM without "CausalLM"/"LMHead"
    assert not is_causal_lm(LlamaForSequenceClassification(llama.config))
    assert not is_causal_lm(tiny_bert())
    # Detected, the decoder gets the next-token shift and may be trained on packed rows (refused for other heads).
    trainer = DPTrainer(model=TinyDecoder(llama.config), args=make_args(tmp_path),
                        data_collator=DataCollatorWithFlattening(), train_dataset=user_dataset(causal_lm=True))
    assert trainer._causal_lm


# ---- one loss per example -----------------------------------------------------------------------------------------


def test_sequence_heads_give_each_examples_cross_entropy_or_squared_error():
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    losses = per_example_loss(logits, labels, causal_lm=False)
    assert losses.shape == (5,) and losses.dtype == torch.float32
    torch.testing.assert_close(losses, torch.stack([F.cross_entropy(logits[i], labels[i]) for i in range(5)]))
    scores, targets = torch.randn(4, 1), torch.randn(4)
    squared_error = (scores.squeeze(-1) - targets) ** 2
    torch.testing.assert_close(per_example_loss(scores, targets, causal_lm=False), squared_error)
    # One output is regression whatever the labels' dtype (transformers' problem_type rule): integer targets too.
    integers = torch.tensor([0, 3, 1, 2])
    torch.testing.assert_close(per_example_loss(scores, integers, causal_lm=False),
                               (scores.squeeze(-1) - integers.float()) ** 2)


def test_token_heads_average_each_examples_labelled_tokens_after_the_causal_shift():
    vocab = 7
    logits = torch.randn(3, 5, vocab)
    labels = torch.randint(0, vocab, (3, 5))
    labels[0, 3:] = -100  # padding
    labels[2] = -100  # no labelled token at all
    plain = per_example_loss(logits, labels, causal_lm=False)
    shifted = per_example_loss(logits, labels, causal_lm=True)
    for i in range(3):
        for loss, lg, lb in ((plain[i], logits[i], labels[i]), (shifted[i], logits[i, :-1], labels[i, 1:])):
            kept = lb != -100
            expected = F.cross_entropy(lg[kept], lb[kept]) if kept.any() else torch.tensor(0.0)
            torch.testing.assert_close(loss, expected)
    assert shifted[2] == 0 and plain[2] == 0
    # Each example's loss is its own: computed alone or in the batch, the same.
    torch.testing.assert_close(per_example_loss(logits[1:2], labels[1:2], causal_lm=True), shifted[1:2])


def test_packed_rows_give_the_losses_of_the_same_examples_padded():
    """Two examples (3 and 4 tokens) packed in one row, positions restarting: each keeps its own loss, and the
    next-token shift never crosses from one example into the next."""
    vocab = 9
    lengths = [3, 4]
    tokens = torch.randint(0, vocab, (1, sum(lengths)))
    packed_logits = torch.randn(1, sum(lengths), vocab)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    example_ids = packed_example_ids({"position_ids": position_ids})
    assert example_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    padded_logits = torch.zeros(2, max(lengths), vocab)
    padded_labels = torch.full((2, max(lengths)), -100)
    start = 0
    for i, n in enumerate(lengths):
        padded_logits[i, :n] = packed_logits[0, start:start + n]
        padded_labels[i, :n] = tokens[0, start:start + n]
        start += n
    for causal_lm in (True, False):
        packed = packed_per_example_loss(packed_logits, tokens, example_ids, 2, causal_lm=causal_lm)
        torch.testing.assert_close(packed, per_example_loss(padded_logits, padded_labels, causal_lm=causal_lm))
    with pytest.raises(ValueError, match="token-level logits"):
        packed_per_example_loss(torch.randn(1, vocab), tokens, example_ids, 2, causal_lm=True)


def test_packed_rows_are_found_by_restarting_positions_and_refused_with_an_attention_mask():
    assert packed_example_ids({"input_ids": torch.ones(2, 4, dtype=torch.long)}) is None
    assert packed_example_ids({"position_ids": torch.arange(5).repeat(2, 1)}) is None  # one example per row
    left_padded = {"position_ids": torch.tensor([[1, 1, 0, 1, 2]]), "attention_mask": torch.tensor([[0, 0, 1, 1, 1]])}
    assert packed_example_ids(left_padded) is None  # padding may carry any position
    restarting = torch.tensor([[0, 1, 0, 1, 2]])
    assert packed_example_ids({"position_ids": restarting}).tolist() == [[0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="Packed rows .* with an attention_mask"):
        packed_example_ids({"position_ids": restarting, "attention_mask": torch.ones_like(restarting)})


def test_underlying_model_unwraps_peft_and_compile_wrappers():
    from peft import LoraConfig, get_peft_model

    llama = tiny_llama()
    compiled = torch.compile(llama)
    assert underlying_model(compiled) is llama and is_causal_lm(compiled)
    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], lora_alpha=4))
    assert isinstance(underlying_model(peft_model), LlamaForCausalLM) and is_causal_lm(peft_model)
    assert underlying_model(llama) is llama
