"""A fabricated results folder for the app and publishing tests (tiny config-built models, built offline).

`make_results_dir(root)` writes what `hf-dp demo` would: result JSONs (keys of
`hf_dp.workflows.run_results.RESULT_KEYS`, mechanisms named by `hf_dp.vocabulary.MECHANISMS`), saved models with
tokenizers and privacy cards under `models/<run>/`, and `summary.json`; plus a causal-LM run. `make_chat_results_dir`
writes a chat-SFT study (task `chat-sft`: baseline, non-private, ULS) of tiny Llamas with a chat template. The
numbers are invented; nothing here trains.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from hf_dp.card import write_privacy_card
from hf_dp.card_check import ledger_facts
from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows.tasks.classifier_models import EmbeddingClassifier

LABELS = ["comedy", "history", "tragedy"]
WORDS = (
    "the a of and to my i you is in king crown england france war love lady jest music food play on death blood "
    "spot out say once more unto breach dear friends close wall up with our english dead if be give me excess it "
    "sweet will walk masque tonight have tell liege french are landed nobles north rise arms against here's smell "
    "still , . ! ? ; ' damned"
).split()


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer over WORDS (plus special tokens), built in code."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", eos_token="[EOS]",
                                   model_max_length=32)


# ChatML-like, in the tokenizer's words: [CLS] opens a turn, [SEP] ends it (SmolLM2's has no generation marks either)
CHAT_TEMPLATE = ("{% for m in messages %}[CLS] {{ m['role'] }} {{ m['content'] }} [SEP] {% endfor %}"
                 "{% if add_generation_prompt %}[CLS] assistant {% endif %}")


CHAT_SYSTEM_PROMPT = "you are the king of england"


def make_chat_tokenizer() -> PreTrainedTokenizerFast:
    """`make_tokenizer` with a chat template (the role names are unknown words to it)."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_classifier(seed: int, vocab_size: int) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)}, pad_token_id=0,
    )
    return BertForSequenceClassification(config)


def tiny_embedding_classifier(seed: int, vocab_size: int) -> EmbeddingClassifier:
    """The similarity-head classifier `hf_dp.workflows.tasks.classification` fine-tunes by default (encoder +
    prototypes)."""
    from transformers import BertModel

    encoder = BertModel(tiny_classifier(seed, vocab_size).config, add_pooling_layer=False)
    return EmbeddingClassifier(encoder, len(LABELS), label_names=LABELS)


def tiny_chat_lm(seed: int, vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=4, bos_token_id=2)
    return LlamaForCausalLM(config)


def tiny_lm(seed: int, vocab_size: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=64, bos_token_id=4,
                        eos_token_id=4, pad_token_id=0)
    return GPT2LMHeadModel(config)


def privacy_report(mechanism: str, epsilon: float, target: float) -> dict:
    """What `DPTrainer.privacy_report()` returns for a run of `mechanism` (a DP key of `MECHANISMS`): `mechanism` is
    the key, `mechanism_description` its sentence, `sampling` the argument (None at the example level)."""
    entry = MECHANISMS[mechanism]
    return {
        "epsilon": epsilon, "epsilon_lower": epsilon * 0.98, "epsilon_estimate": epsilon * 0.99, "delta": 1e-5,
        "target_epsilon": target, "privacy_unit": entry.privacy_unit, "sampling": entry.sampling,
        "mechanism": mechanism, "mechanism_description": entry.description, "noise_multiplier": 1.1,
        "sample_rate": 0.08, "expected_batch_size": 96, "steps": 40, "max_grad_norm": 1.0,
        "contribution_bound": 2 if mechanism != "example" else None, "num_users": 1101, "num_examples": 2000,
        "accountant": "prv-accountant (test)",
        "epsilon_group_privacy": 40.0 if mechanism == "els" else None, "noise_seed": "os-entropy",
    }


def privacy_ledger(report: dict) -> dict:
    """The ledger `DPTrainer.privacy_ledger()` would write for `report` (its q, σ, steps, G): what publishing
    checks."""
    from hf_dp.accounting import PrivacyAccountant

    accountant = PrivacyAccountant()
    accountant.step(sample_rate=report["sample_rate"], noise_multiplier=report["noise_multiplier"],
                    group_size=report["contribution_bound"] if report["mechanism"] == "els" else 1,
                    steps=report["steps"])
    return {"format": 1, "delta": report.get("delta_accountant", report["delta"]),
            "privacy_unit": report["privacy_unit"], "sampling": report["sampling"], "mechanism": report["mechanism"],
            "accountant": accountant.state_dict(),
            "noise": {"draws_per_step": 10**4, "tail_per_draw": 2.0**-159, "reach": 14.8466},
            "report": ledger_facts(report)}


def verified_report(mechanism: str = "uls", target: float = 8.0, **changes) -> tuple[dict, dict]:
    """A report of `mechanism` whose every figure its ledger proves, as `DPTrainer` writes them, and that ledger: ε,
    its bounds, δ and the group-privacy ε computed here from the accountant (q = 0.08, σ = 1.1, 40 steps, δ = 1e-5),
    with `changes` applied to the recorded figures first."""
    from hf_dp.accounting import PrivacyAccountant, group_privacy_epsilon
    from hf_dp.accounting.floating_point import sampler_delta
    from hf_dp.report import ACCOUNTANT_NAME
    from hf_dp.mechanisms import get_mechanism

    report = {**privacy_report(mechanism, 0.0, target), "delta_accountant": 1e-5, "noise_reach": 14.8466,
              "effective_noise_multiplier": 1.1, "logging_noise_multiplier": None, "max_loss": None,
              "accountant": ACCOUNTANT_NAME + get_mechanism(mechanism).accountant_note, **changes}
    ledger = privacy_ledger(report)
    accountant = PrivacyAccountant()
    accountant.load_state_dict(ledger["accountant"])
    lower, estimate, upper = accountant.epsilon_bounds(1e-5)
    added = sampler_delta(epsilon=upper, delta=1e-5, draws=report["steps"] * 10**4)
    loose = group_privacy_epsilon(sample_rate=report["sample_rate"], noise_multiplier=1.1, steps=report["steps"],
                                  delta=1e-5, group_size=report["contribution_bound"]) if mechanism == "els" else None
    report.update(epsilon=upper, epsilon_lower=lower, epsilon_estimate=estimate, delta=1e-5 + added,
                  delta_floating_point=added, epsilon_training=upper, epsilon_group_privacy=loose)
    return report, ledger


def _result(run: str, mechanism: str, *, eval_result: float, epsilon, target, model_dir, base_path: str,
            task: str = "classification", metric_name: str = "accuracy", privacy=None, delta=None,
            baseline_result: float = 0.40, **extra) -> dict:
    """A result JSON as `hf_dp.workflows.run_results.save_result` writes it (keys `RESULT_KEYS` there)."""
    return {
        "run": run, "mechanism": mechanism, "target_epsilon": target, "epsilon": epsilon, "delta": delta,
        "privacy": privacy, "metric_name": metric_name, "eval_result": eval_result,
        "baseline_result": baseline_result, "model_dir": model_dir, "base_model": base_path, "task": task,
        "train_seconds": 1.0, "eval_seconds": 0.1, **extra,
        "label_names": LABELS if task == "classification" else None, "num_eval_examples": 10,
        "config": {"model_name_or_path": base_path, "max_length": 32,
                   "label_descriptions": {n: [f"a {n} play"] for n in LABELS}},
    }


def make_results_dir(root: str | Path) -> Path:
    """Write a fabricated study into `root/results` (base models in `root/base-*`); return the results folder."""
    root = Path(root)
    results = root / "results"
    tokenizer = make_tokenizer()
    vocab_size = len(tokenizer)
    base = root / "base-encoder"
    tiny_classifier(0, vocab_size).save_pretrained(base)
    tokenizer.save_pretrained(base)

    runs = [_result("baseline", "public-only", eval_result=0.40, epsilon=0.0, target=None, model_dir=None,
                    base_path=str(base), delta=0.0)]
    specs = [("non-private", "non-private", 0.80, None, None), ("uls-eps1", "uls", 0.50, 0.98, 1.0),
             ("uls-eps8", "uls", 0.70, 7.9, 8.0), ("els-eps8", "els", 0.66, 7.95, 8.0)]
    for seed, (run, mechanism, metric, epsilon, target) in enumerate(specs, start=1):
        model_dir = results / "models" / run
        # uls-eps8 has the default similarity head; the others a linear head (AutoModelForSequenceClassification)
        build = tiny_embedding_classifier if run == "uls-eps8" else tiny_classifier
        build(seed, vocab_size).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        private = MECHANISMS[mechanism].is_private
        report = privacy_report(mechanism, epsilon, target) if private else {"non_private": True}
        write_privacy_card(report, model_dir, base_model="test/tiny-encoder", eval_result=metric,
                           baseline_result=0.40, dataset_name="test-plays")
        runs.append(_result(run, mechanism, eval_result=metric, epsilon=epsilon, target=target,
                            model_dir=f"models/{run}", base_path=str(base), privacy=report if private else None,
                            delta=1e-5 if private else None))

    lm_base = root / "base-lm"
    tiny_lm(10, vocab_size).save_pretrained(lm_base)
    tokenizer.save_pretrained(lm_base)
    lm_dir = results / "models" / "lm-uls-eps8"
    tiny_lm(11, vocab_size).save_pretrained(lm_dir)
    tokenizer.save_pretrained(lm_dir)
    lm_report = privacy_report("uls", 7.9, 8.0)
    write_privacy_card(lm_report, lm_dir, base_model="test/tiny-lm", task="text-generation",
                       metric_name="perplexity", eval_result=30.0, baseline_result=35.0)
    runs.append(_result("lm-uls-eps8", "uls", eval_result=30.0, epsilon=7.9, target=8.0,
                        model_dir="models/lm-uls-eps8", base_path=str(lm_base), task="causal-lm",
                        metric_name="perplexity", privacy=lm_report, delta=1e-5, baseline_result=35.0,
                        non_private_result=28.0))

    results.mkdir(parents=True, exist_ok=True)
    for result in runs:
        (results / f"{result['run']}.json").write_text(json.dumps(result, indent=2))
    (results / "summary.json").write_text(json.dumps({"quick": False, "runs": runs}))
    return results


def make_chat_results_dir(root: str | Path) -> Path:
    """Write a fabricated chat-SFT study into `root/chat-results` (base model in `root/base-chat`): `baseline`
    (public-only, no model), `non-private` and `uls-eps8` with models, as `hf-dp demo --task sft` would."""
    root = Path(root)
    results = root / "chat-results"
    tokenizer = make_chat_tokenizer()
    vocab_size = len(tokenizer)
    base = root / "base-chat"
    tiny_chat_lm(20, vocab_size).save_pretrained(base)
    tokenizer.save_pretrained(base)
    chat = dict(task="chat-sft", metric_name="completion perplexity", base_path=str(base), baseline_result=40.0)
    runs = [_result("baseline", "public-only", eval_result=40.0, epsilon=0.0, target=None, model_dir=None,
                    delta=0.0, **chat)]
    for seed, (run, mechanism, metric) in enumerate((("non-private", "non-private", 25.0),
                                                     ("uls-eps8", "uls", 31.0)), start=21):
        model_dir = results / "models" / run
        tiny_chat_lm(seed, vocab_size).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        private = MECHANISMS[mechanism].is_private
        report = privacy_report(mechanism, 7.9, 8.0) if private else {"non_private": True}
        write_privacy_card(report, model_dir, base_model="test/tiny-chat", task="text-generation",
                           metric_name="completion perplexity", eval_result=metric, baseline_result=40.0)
        runs.append(_result(run, mechanism, eval_result=metric, epsilon=7.9 if private else None,
                            target=8.0 if private else None, model_dir=f"models/{run}",
                            privacy=report if private else None, delta=1e-5 if private else None, **chat))
    for result in runs:  # the study's system prompt, in the runs' configs
        result["config"]["system_prompt"] = CHAT_SYSTEM_PROMPT
    results.mkdir(parents=True, exist_ok=True)
    for result in runs:
        (results / f"{result['run']}.json").write_text(json.dumps(result, indent=2))
    (results / "summary.json").write_text(json.dumps({"quick": False, "runs": runs}))
    return results
