"""Canary scores: per-row losses agree with the model's own loss, and scores are base - trained."""

import numpy as np
import pytest
import torch

from hf_dp.audit import loss_scores, per_row_losses, trained_loss_scores


def test_loss_scores():
    scores = loss_scores([[1.0, 2.0], [3.0]], [[2.0, 3.0], [2.5]])
    np.testing.assert_allclose(scores, [1.0, -0.5])
    with pytest.raises(ValueError, match="one entry per canary"):
        loss_scores([[1.0]], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="canary 0 has 2 trained and 1 base"):
        loss_scores([[1.0, 2.0]], [[1.0]])
    with pytest.raises(ValueError, match="non-finite"):
        loss_scores([[float("nan")]], [[1.0]])


def test_trained_loss_scores():
    np.testing.assert_allclose(trained_loss_scores([[1.0, 2.0], [3.0]]), [-1.5, -3.0])
    with pytest.raises(ValueError, match="canary 1 has no rows"):
        trained_loss_scores([[1.0], []])
    with pytest.raises(ValueError, match="non-finite"):
        trained_loss_scores([[float("inf")]])


def _pad(rows, pad_id=0):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return ids, mask


def _lm_collator(rows):
    ids, mask = _pad(rows)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _cls_collator(rows):
    ids, mask = _pad(rows)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["label"] for r in rows])}


def test_causal_lm_rows_match_model_loss():
    import transformers
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(1, 50, size=n).tolist()} for n in (5, 9, 3, 7, 6)]
    losses = per_row_losses(model, rows, _lm_collator, batch_size=2)
    assert losses.shape == (5,) and model.training  # training mode is restored
    with torch.no_grad():
        model.eval()
        expected = [model(**_lm_collator([row])).loss.item() for row in rows]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_classification_rows_match_model_loss():
    import transformers
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3
    )
    model = transformers.BertForSequenceClassification(config).eval()
    rng = np.random.default_rng(1)
    rows = [{"input_ids": rng.integers(1, 50, size=n).tolist(), "label": int(rng.integers(0, 3))} for n in (4, 8, 6)]
    losses = per_row_losses(model, rows, _cls_collator, batch_size=3)
    with torch.no_grad():
        expected = [model(**_cls_collator([row])).loss.item() for row in rows]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    with pytest.raises(ValueError, match="no 'labels'"):
        per_row_losses(model, rows, lambda b: {"input_ids": _pad(b)[0]}, batch_size=2)


def test_chat_rows_are_scored_on_their_completion_tokens_only():
    """The SFT scoring path (rows tokenized as DPSFTTrainer tokenizes them, CausalLMCollator) takes each row's loss
    over its reply tokens only: the prompt, system message and padding are never targets."""
    import datasets
    import torch.nn.functional as F

    from hf_dp.workflows.tasks.chat_sft import tokenize_prompt_completion
    from hf_dp.workflows.tasks.language_modeling import CausalLMCollator
    from tests.workflows.test_chat_sft import chat_tokenizer, tiny_chat_model

    tokenizer, model = chat_tokenizer(), tiny_chat_model().eval()
    rows = datasets.Dataset.from_dict({
        "prompt": [[{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}],
                   [{"role": "user", "content": "w6"}]],
        "completion": [[{"role": "assistant", "content": "w7 w8"}], [{"role": "assistant", "content": "w9 w10 w11"}]],
    })
    features = tokenize_prompt_completion(rows, tokenizer, max_length=None)
    collator = CausalLMCollator(tokenizer.pad_token_id)
    losses = per_row_losses(model, list(features), collator)
    for row, loss in zip(features, losses):
        ids = torch.tensor([row["input_ids"]])
        targets = torch.tensor(row["labels"][1:])
        reply = targets != -100
        # reply tokens: "w7 w8 <|end|>" after "<|assistant|>" (the template's generation prompt)
        assert tokenizer.decode(targets[reply]).split()[-1] == "<|end|>" and int(reply.sum()) >= 3
        assert int((~reply).sum()) > 0  # the prompt is there, and masked
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        expected = F.cross_entropy(logits[reply], targets[reply])
        everything = F.cross_entropy(logits, torch.tensor(row["input_ids"][1:]))
        assert loss == pytest.approx(float(expected), rel=1e-5)
        assert abs(loss - float(everything)) > 1e-3  # so the prompt's tokens would have changed it
