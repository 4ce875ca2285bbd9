"""GhostClipper on transformers' text families, against the shared oracle (`clipping_oracle.py`).

One row per (family, full fine-tuning / LoRA): a tiny model built from its config (width 16,
1-2 layers, vocabulary 48, no dropout, float64, random weights, LoRA r=4 with random B), six
right-padded examples in three users of one to three examples each, per-unit norms and
clipped sums compared with brute-force per-example gradients to a relative error of 1e-5.
Decoder-only families are causal LMs, encoders sequence classifiers, encoder-decoders
conditional generators (BART and T5 families, with padded decoder inputs as long as the
batch is large, so that T5's shared `(T, T)` relative-bias lookup could be mistaken for
batch rows).

What each family exercises beyond GPT-2 / Llama / BERT / Qwen2 (`test_architectures.py`; each rule on its
own: `test_linear.py`, `test_embedding.py`, `test_norm.py`, `test_position_bias.py`):
rows flattened to `(B·T, d)` (OPT's feed-forward block), embeddings that scale their
output or compute their own position ids (Gemma, BART, mBART, OPT), T5's relative
attention bias, `*LayerNorm`-named RMS norms (T5), fused and parallel attention
(GPT-NeoX, Falcon, BLOOM's ALiBi, Phi-3), multi-query attention (GPTBigCode, Falcon),
`nn.Linear` subclasses with their own forward (Falcon), non-parametric LayerNorm (OLMo),
q/k norms (Qwen3, OLMo2), local attention (GPT-Neo, ModernBERT), frozen sinusoidal
positions (Pegasus), learned positions offset by the padding index (RoBERTa family).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
import transformers
from clipping_oracle import UNIT_IDS, assert_rel_close, check_against_oracle, oracle_clip
from tiny_models import PAD, VOCAB, per_example_loss, tiny_batch

from hf_dp.clipping import GhostClipper, UnsupportedLayerError

HIDDEN = 16
_HEADS = {"causal_lm": "ForCausalLM", "seq_cls": "ForSequenceClassification", "seq2seq": "ForConditionalGeneration"}
_TASKS = {"causal_lm": "CAUSAL_LM", "seq_cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}


@dataclass(frozen=True)
class Family:
    """A transformers family: `<prefix>Config` and `<prefix><head class>`, tiny settings, LoRA targets."""

    prefix: str
    head: str
    config: Dict = field(default_factory=dict)
    lora_targets: Tuple[str, ...] = ("q_proj", "v_proj")
    attn_implementation: str = "eager"


def _config(**overrides) -> Dict:
    return dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, num_labels=3, **overrides)


_LLAMA_LIKE = dict(
    hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=32,
)
_BERT_LIKE = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * HIDDEN,
    max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)
_BART_LIKE = dict(
    d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN, max_position_embeddings=32, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, forced_eos_token_id=None,
)
_T5_LIKE = dict(
    d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=1, num_decoder_layers=1, num_heads=2,
    relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=PAD,
)
_GPT2_DROPOUTS = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

FAMILIES: Dict[str, Family] = {
    # decoder-only causal LMs
    "gpt_neox": Family("GPTNeoX", "causal_lm", _config(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0), ("query_key_value",)),
    "gpt_neo": Family("GPTNeo", "causal_lm", _config(
        hidden_size=HIDDEN, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]], window_size=4,
        max_position_embeddings=32, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0)),
    "gptj": Family("GPTJ", "causal_lm", _config(n_embd=HIDDEN, n_layer=2, n_head=2, rotary_dim=4, n_positions=32,
                                                **_GPT2_DROPOUTS)),
    "gpt_bigcode": Family("GPTBigCode", "causal_lm", _config(n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=32,
                                                             **_GPT2_DROPOUTS), ("c_attn",)),
    "bloom": Family("Bloom", "causal_lm", _config(hidden_size=HIDDEN, n_layer=2, n_head=2, hidden_dropout=0.0,
                                                  attention_dropout=0.0), ("query_key_value",)),
    "falcon": Family("Falcon", "causal_lm", _config(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                                    hidden_dropout=0.0, attention_dropout=0.0), ("query_key_value",)),
    "opt": Family("OPT", "causal_lm", _config(
        hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
        word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0)),
    "phi": Family("Phi", "causal_lm", _config(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "phi3": Family("Phi3", "causal_lm", _config(**_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
                   ("qkv_proj",)),
    "mistral": Family("Mistral", "causal_lm", _config(**_LLAMA_LIKE)),
    "qwen2": Family("Qwen2", "causal_lm", _config(**_LLAMA_LIKE)),
    "qwen3": Family("Qwen3", "causal_lm", _config(**_LLAMA_LIKE, head_dim=8)),
    "olmo": Family("Olmo", "causal_lm", _config(**_LLAMA_LIKE)),
    "olmo2": Family("Olmo2", "causal_lm", _config(**_LLAMA_LIKE)),
    "stablelm": Family("StableLm", "causal_lm", _config(**_LLAMA_LIKE, hidden_dropout=0.0, attention_dropout=0.0)),
    "granite": Family("Granite", "causal_lm", _config(**_LLAMA_LIKE)),
    "smollm3": Family("SmolLM3", "causal_lm", _config(**_LLAMA_LIKE)),
    "starcoder2": Family("Starcoder2", "causal_lm", _config(**_LLAMA_LIKE, residual_dropout=0.0,
                                                            embedding_dropout=0.0, attention_dropout=0.0)),
    "gemma": Family("Gemma", "causal_lm", _config(**_LLAMA_LIKE, head_dim=8)),
    "gemma2": Family("Gemma2", "causal_lm", _config(**_LLAMA_LIKE, head_dim=8)),
    # encoders, sequence classification
    "roberta": Family("Roberta", "seq_cls", _config(**_BERT_LIKE), ("query", "value")),
    "xlm_roberta": Family("XLMRoberta", "seq_cls", _config(**_BERT_LIKE), ("query", "value")),
    "electra": Family("Electra", "seq_cls", _config(**_BERT_LIKE, embedding_size=8), ("query", "value")),
    "distilbert": Family("DistilBert", "seq_cls", _config(
        dim=HIDDEN, n_layers=2, n_heads=2, hidden_dim=2 * HIDDEN, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0), ("q_lin", "v_lin")),
    # DeBERTa-v2 without relative attention; with it (DeBERTa-v3) it is refused, see below.
    "deberta_v2": Family("DebertaV2", "seq_cls", _config(**_BERT_LIKE, pooler_dropout=0.0),
                         ("query_proj", "value_proj")),
    # Eager attention gives NaN gradients for fully masked rows of the local-attention mask in float64.
    "modernbert": Family("ModernBert", "seq_cls", _config(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * HIDDEN,
        max_position_embeddings=32, global_attn_every_n_layers=2, local_attention=4, embedding_dropout=0.0,
        mlp_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0, cls_token_id=1, sep_token_id=2),
        ("Wqkv",), attn_implementation="sdpa"),
    # encoder-decoders
    "bart": Family("Bart", "seq2seq", _config(**_BART_LIKE, decoder_start_token_id=2)),
    "mbart": Family("MBart", "seq2seq", _config(**_BART_LIKE, decoder_start_token_id=2)),
    "pegasus": Family("Pegasus", "seq2seq", _config(**_BART_LIKE, decoder_start_token_id=PAD)),
    "t5": Family("T5", "seq2seq", _config(**_T5_LIKE), ("q", "v")),
    "mt5": Family("MT5", "seq2seq", _config(**_T5_LIKE), ("q", "v")),
}

BATCH_SIZE, SEQ_LEN, DECODER_LEN = len(UNIT_IDS), 8, len(UNIT_IDS)  # decoder length = batch size, on purpose


def family_model(name: str, lora: bool = False, *, seed: int = 0, **config_overrides) -> torch.nn.Module:
    family = FAMILIES[name]
    config = getattr(transformers, family.prefix + "Config")(**{**family.config, **config_overrides})
    config._attn_implementation = family.attn_implementation
    torch.manual_seed(seed)
    model = getattr(transformers, family.prefix + _HEADS[family.head])(config).to(torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(family.lora_targets),
            task_type=_TASKS[family.head],
        )
        model = get_peft_model(model, lora_config)
        with torch.no_grad():  # peft starts lora_B at zero: randomise it so both factors get gradients
            generator = torch.Generator().manual_seed(seed + 1)
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model.train()


def family_batch(head: str, seed: int = 0) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Model inputs and labels: right padding, ragged lengths."""
    batch = tiny_batch(BATCH_SIZE, SEQ_LEN, head="seq_cls" if head == "seq_cls" else "causal_lm", seed=seed)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if head != "seq2seq":
        return inputs, batch["labels"]
    decoder = tiny_batch(BATCH_SIZE, DECODER_LEN, head="causal_lm", seed=seed + 100)
    inputs["decoder_input_ids"] = decoder["input_ids"]
    inputs["decoder_attention_mask"] = decoder["attention_mask"]
    labels = decoder["input_ids"].roll(-1, dims=1).masked_fill(decoder["attention_mask"] == 0, -100)
    labels[:, -1] = -100  # the next decoder token, none after the last
    return inputs, labels


def family_loss(head: str):
    if head != "seq2seq":
        return lambda output, labels: per_example_loss(output.logits, labels, head)

    def seq2seq_loss(output, labels):  # mean cross-entropy over each example's labelled decoder tokens
        token_loss = F.cross_entropy(output.logits.transpose(-1, -2), labels, ignore_index=-100, reduction="none")
        return token_loss.sum(-1) / (labels != -100).sum(-1).clamp(min=1)

    return seq2seq_loss


def _rows(names: List[str]):
    return [
        pytest.param(name, lora, id=f"{name}-{'lora' if lora else 'full'}") for name in names for lora in (False, True)
    ]


# ---------------------------------------------------------------------------------------
# The table


@pytest.mark.parametrize("name,lora", _rows(list(FAMILIES)))
def test_family_matches_oracle(name, lora):
    model = family_model(name, lora)
    inputs, labels = family_batch(FAMILIES[name].head)
    check_against_oracle(model, inputs, labels, family_loss(FAMILIES[name].head), UNIT_IDS)


@pytest.mark.parametrize("name,lora", _rows(["opt", "bart", "t5", "gemma", "falcon"]))
def test_family_with_gradient_checkpointing_matches_oracle(name, lora):
    """Flattened rows, own-forward embeddings and linears, T5's bias, encoder-decoders: recomputed blocks."""
    model = family_model(name, lora)
    head = FAMILIES[name].head
    inputs, labels = family_batch(head, seed=1)
    norms_oracle, clipped_oracle = oracle_clip(model, inputs, labels, family_loss(head), UNIT_IDS, 0.5)
    model.activation_checkpointing_enable()
    with GhostClipper(model) as clipper:
        norms = clipper.backward(family_loss(head)(model(**inputs), labels), unit_ids=UNIT_IDS, max_grad_norm=0.5)
    assert torch.allclose(norms.double(), norms_oracle, rtol=1e-5, atol=0)
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            assert_rel_close(param.grad, clipped_oracle[param_name], param_name)


# ---------------------------------------------------------------------------------------
# What stays refused


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_deberta_v3_relative_position_table_is_refused_naming_its_layers(lora):
    """DeBERTa-v3's relative attention runs key/query projections (and their LoRA adapters) on the
    position table, once for the whole batch and repeated over it: no per-example gradient."""
    model = family_model(
        "deberta_v2", lora, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        share_att_key=True, norm_rel_ebd="layer_norm",
    )
    inputs, labels = family_batch("seq_cls")
    clipper = GhostClipper(model)
    losses = family_loss("seq_cls")(model(**inputs), labels)
    with pytest.raises(UnsupportedLayerError, match=r"query_proj.*freeze") as raised:
        clipper.backward(losses, unit_ids=UNIT_IDS, max_grad_norm=1.0)
    assert ("lora_A" in str(raised.value)) == lora
    assert all(param.grad is None for param in model.parameters())  # nothing written
