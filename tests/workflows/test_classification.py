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
    accuracy,
    compute_metrics,
    load_classification_data,
    run_classification,
    tokenize_classification,
)
from hf_dp.workflows.tasks.classifier_models import EmbeddingClassifier, load_classifier, predict_labels
from hf_dp.vocabulary import EVAL_KEYS, MECHANISMS
from hf_dp.workflows.run_results import RESULT_KEYS, load_result

ROOT = Path(__file__).resolve().parents[2]
WORDS = {"war": "history", "crown": "history", "king": "history", "jest": "comedy", "wed": "comedy",
         "fool": "comedy", "death": "tragedy", "blood": "tragedy", "grave": "tragedy"}
FILLER = "the a my lord good sweet come speak".split()



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
        run="toy", results_dir=str(tmp_path), dataset=data_path, user_id_column="author", text_column="body",
        label_column="genre", model_name_or_path=model_dir, max_length=12, eval_batch_size=32, progress=False,
        lora_target_modules=["query", "value"],
    )
    settings.update(overrides)
    return ClassificationConfig(**settings)


def toy_training(config: ClassificationConfig, mechanism: str, **overrides):
    """The toy runs' training arguments (DPTrainingArguments / TrainingArguments field names)."""
    if mechanism == "non-private":
        fields = dict(max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2)
    else:
        fields = dict(expected_batch_size=8, contribution_bound=2, max_steps=3, per_device_train_batch_size=16,
                      learning_rate=1e-2, noise_seed=0)
        if mechanism == "example":
            fields.pop("contribution_bound")
    fields.update(overrides)
    return config.training_arguments(mechanism, **fields)


# ---- metrics and data -----------------------------------------------------------------------------------


def test_accuracy_and_compute_metrics():
    assert accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75
    logits = np.array([[2.0, 0.1, 0.0], [0.0, 0.0, 3.0]])
    assert compute_metrics((logits, np.array([0, 1]))) == {"accuracy": 0.5}
    with pytest.raises(ValueError):
        accuracy([0, 1], [0])


def test_config_rejects_bad_run_name_and_training_arguments_unknown_mechanism(tmp_path):
    with pytest.raises(ValueError, match="run"):
        ClassificationConfig(run="a/b")
    config = ClassificationConfig(run="x", results_dir=str(tmp_path))
    with pytest.raises(ValueError, match="mechanism='dp'"):
        config.training_arguments("dp")
    with pytest.raises(ValueError, match="public-only"):
        config.training_arguments("public-only")
    with pytest.raises(ValueError, match="target_epsilon=3.*non-private run has no privacy settings"):
        config.training_arguments("non-private", target_epsilon=3)
    with pytest.raises(ValueError, match="sampling follows from the mechanism"):
        config.training_arguments("uls", sampling="els")


def test_run_config_has_no_privacy_fields():
    """Privacy settings live in DPTrainingArguments only: the run config repeats none of them."""
    import dataclasses

    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments

    run_fields = {f.name for f in dataclasses.fields(ClassificationConfig)}
    training_fields = {f.name for f in dataclasses.fields(DPTrainingArguments)}
    privacy_fields = training_fields - {f.name for f in dataclasses.fields(TrainingArguments)}
    # the user column is the one setting both need: the split by user, and the privacy unit (checked equal)
    assert run_fields & training_fields == {"user_id_column", "seed"}
    assert run_fields & privacy_fields == {"user_id_column"}
    assert "method" not in run_fields and "mechanism" not in run_fields


def test_training_arguments_follow_the_mechanism(tmp_path):
    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments

    config = ClassificationConfig(run="e", results_dir=str(tmp_path), user_id_column="customer")
    els = config.training_arguments("els", target_epsilon=3.0)
    assert isinstance(els, DPTrainingArguments) and (els.privacy_unit, els.sampling) == ("user", "els")
    assert els.user_id_column == "customer" and els.target_epsilon == 3.0
    defaults = DPTrainingArguments(output_dir=str(tmp_path))  # what is not given is DPTrainingArguments' default
    assert (els.expected_batch_size, els.contribution_bound, els.max_grad_norm) == (
        defaults.expected_batch_size, defaults.contribution_bound, defaults.max_grad_norm)
    example = config.training_arguments("example")
    assert example.mechanism == "example"
    plain = config.training_arguments("non-private")
    assert type(plain) is TrainingArguments
    assert Path(plain.output_dir) == tmp_path / "models" / "e"


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


def test_zero_shot_baseline_on_real_minilm_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    zero_shot = EmbeddingClassifier.from_descriptions(None, ["comedy", "history", "tragedy"], LABEL_DESCRIPTIONS)
    texts = [
        "Let us be merry, sweet love: we shall jest and dance at the wedding feast tonight.",
        "The King of England marches his army into France to claim the crown.",
        "O murder most foul! His blood cries for revenge from the grave.",
    ]

    embeddings = zero_shot.embed(texts)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(3))
    with torch.no_grad():  # logits are 20 x the cosine similarities to the label prototypes
        cosines = embeddings @ torch.nn.functional.normalize(zero_shot.head.weight, dim=-1).T
        encoded = zero_shot.tokenizer(texts, padding=True, return_tensors="pt")
        torch.testing.assert_close(zero_shot(**encoded).logits, 20.0 * cosines, atol=1e-4, rtol=1e-4)
    assert predict_labels(zero_shot, zero_shot.tokenizer, texts).tolist() == [0, 1, 2]


# ---- end-to-end runs on a tiny BERT ----------------------------------------------------------------------


@pytest.mark.parametrize("mechanism,use_lora,head", [
    ("uls", True, "similarity"), ("els", False, "similarity"), ("example", True, "linear"),
    ("non-private", False, "similarity"), ("uls", False, "linear"), ("non-private", True, "linear"),
])
def test_run_classification_end_to_end(tmp_path, toy_jsonl, tiny_bert_dir, mechanism, use_lora, head):
    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, run=f"toy-{mechanism}", use_lora=use_lora,
                        max_eval_examples=20, head=head, non_private_result=0.5)
    training_args = toy_training(config, mechanism, **({} if mechanism == "non-private" else {"target_epsilon": 8.0}))
    result = run_classification(config, training_args)
    assert set(RESULT_KEYS) <= set(result)
    assert result["mechanism"] == mechanism and result["task"] == "classification"
    assert result["metric_name"] == "accuracy" and 0.0 <= result["eval_result"] <= 1.0
    assert result["num_eval_examples"] == 20 and result["steps"] == 3
    assert result["label_names"] == ["comedy", "history", "tragedy"]
    assert result["non_private_result"] == 0.5
    assert "method" not in result and "metric" not in result and "baseline_metric" not in result
    assert load_result(tmp_path / f"toy-{mechanism}.json")["eval_result"] == pytest.approx(result["eval_result"])
    baseline = load_result(tmp_path / f"toy-{mechanism}-baseline.json")  # computed since none was given
    assert baseline["mechanism"] == "public-only" and baseline["epsilon"] == 0.0
    assert result["baseline_result"] == pytest.approx(baseline["eval_result"])
    assert result["config"]["user_id_column"] == "author"
    if mechanism == "non-private":
        assert result["privacy"] is None and result["epsilon"] is None and result["target_epsilon"] is None
        assert "target_epsilon" not in result["config"]  # no privacy settings recorded for a non-private run
    else:
        privacy = result["privacy"]
        assert privacy["steps"] == 3
        assert 0 < result["epsilon"] <= 8.0 == result["target_epsilon"] == result["config"]["target_epsilon"]
        assert privacy["privacy_unit"] == MECHANISMS[mechanism].privacy_unit
    model_dir = tmp_path / result["model_dir"]
    assert model_dir == tmp_path / "models" / f"toy-{mechanism}"
    card = (model_dir / "README.md").read_text()
    assert "accuracy" in card and f"{result['baseline_result']:.4g}" in card
    assert ("dp-sgd" in card) != (mechanism == "non-private")  # noise_seed=0: labelled as carrying no guarantee
    assert ("no-privacy-guarantee" in card) != (mechanism == "non-private") and "differential-privacy" not in card
    if mechanism != "non-private":  # the card's evaluation block has the result JSON's names and values
        from huggingface_hub.repocard import metadata_load

        evaluation = metadata_load(model_dir / "README.md")["dp_evaluation"]
        assert {key: evaluation[key] for key in EVAL_KEYS} == {key: result[key] for key in EVAL_KEYS}
        from hf_dp.hub import check_privacy_card

        # the trainer's card and ledger agree: `hf-dp publish` would accept them (the report's keys, as written)
        checked = check_privacy_card(model_dir, no_guarantee=True)  # noise_seed=0: accepted only so labelled
        assert checked["mechanism"] == mechanism == result["privacy"]["mechanism"]
    # The saved model (LoRA merged) reloads and predicts like the trained one.
    model, tokenizer = load_classifier(model_dir)
    assert isinstance(model, EmbeddingClassifier) == (head == "similarity")
    assert not any("lora" in name for name, _ in model.named_parameters())
    data = load_classification_data(config)
    predictions = predict_labels(model, tokenizer, data.test["body"], max_length=12)
    assert accuracy(predictions, data.test["labels"]) == pytest.approx(result["eval_result"])
    names = model.label_names if head == "similarity" else list(model.config.id2label.values())
    assert names == ["comedy", "history", "tragedy"]


def test_a_user_column_that_differs_between_config_and_arguments_is_refused(tmp_path, toy_jsonl, tiny_bert_dir):
    from hf_dp import DPTrainingArguments

    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl)  # user_id_column="author"
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1)  # user_id_column="user_id"
    with pytest.raises(ValueError, match="user_id_column: the training arguments say 'user_id', the run config "
                                         "'author'") as error:
        run_classification(config, args)
    assert "\n" not in str(error.value)


def test_similarity_model_starts_as_the_zero_shot_baseline(tmp_path, toy_jsonl, tiny_bert_dir):
    """Before any step the fine-tuned model is the public-only baseline (same predictions)."""
    from hf_dp.workflows.tasks.classification import build_model

    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, use_lora=True)
    data = load_classification_data(config)
    names = data.label_names
    zero_shot = EmbeddingClassifier.from_descriptions(tiny_bert_dir, names, {n: [n] for n in names}, max_length=12)
    start = build_model(config, names)
    texts = list(data.test["body"])
    torch.testing.assert_close(start.head.weight, zero_shot.head.weight)
    assert (predict_labels(start, zero_shot.tokenizer, texts, max_length=12)
            == predict_labels(zero_shot, zero_shot.tokenizer, texts, max_length=12)).all()


def test_the_similarity_head_states_its_classes_in_the_config(tmp_path):
    """An encoder's config says num_labels=2 whatever the head has: the similarity head writes its own classes
    there, so the config (and the labels checked against the head's width) say 3."""
    from transformers import BertConfig, BertModel

    from hf_dp.compatibility import check_class_labels

    encoder = BertModel(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32))
    assert encoder.config.num_labels == 2
    model = EmbeddingClassifier(encoder, 3, label_names=["comedy", "history", "tragedy"])
    assert model.config.num_labels == 3 and model.config.id2label[2] == "tragedy"
    from datasets import Dataset

    check_class_labels(Dataset.from_dict({"labels": [0, 1, 2]}), model.config.num_labels)  # no refusal
    with pytest.raises(ValueError, match="outside 0..2"):
        check_class_labels(Dataset.from_dict({"labels": [0, 3]}), model.config.num_labels)


def test_non_private_training_learns_the_toy_task(tmp_path, toy_jsonl, tiny_bert_dir):
    config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, run="learn", use_lora=False, baseline_result=0.0)
    assert run_classification(config, toy_training(config, "non-private", max_steps=60))["eval_result"] > 0.6  # 1/3


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
        "--output_dir", str(tmp_path / "out"), "--dataset", "data.jsonl", "--user_id_column", "customer",
        "--text_column", "body", "--label_column", "topic", "--use_lora", "--lora_target_modules", "query", "value",
        "--non_private", "--sampling", "els", "--target_epsilon", "3", "--expected_batch_size", "32",
        "--contribution_bound", "4", "--max_length", "48", "--max_steps", "10", "--results-dir", "out",
    ])
    assert (script_args.dataset, script_args.text_column, script_args.results_dir) == ("data.jsonl", "body", "out")
    assert training_args.user_id_column == "customer"  # the DPTrainingArguments field: one flag, one place
    assert not hasattr(script_args, "user_column")
    assert script_args.use_lora and script_args.non_private and script_args.lora_target_modules == ["query", "value"]
    assert script_args.model_name_or_path is None  # the embedded MiniLM
    assert (training_args.sampling, training_args.target_epsilon, training_args.contribution_bound) == ("els", 3.0, 4)
    from hf_dp.workflows.recipes import recipe_run
    from hf_dp.workflows.runs import plain_training_arguments

    assert type(plain_training_arguments(training_args)) is TrainingArguments
    config, plain = recipe_run(ClassificationConfig, script_args, training_args)
    assert type(plain) is TrainingArguments and config.user_id_column == "customer"  # non-private: the split's


def test_classify_recipe_target_epsilon_none_selects_fixed_noise(tmp_path):
    """`--target_epsilon None` (DPTrainingArguments' documented fixed-σ mode) is reachable from the command line."""
    recipe = _load_recipe("classify")
    _, training_args = recipe.make_parser().parse_args_into_dataclasses([
        "--output_dir", str(tmp_path / "out"), "--target_epsilon", "None", "--noise_multiplier", "1.5"])
    assert training_args.target_epsilon is None and training_args.noise_multiplier == 1.5
    _, default = recipe.make_parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path / "out")])
    assert default.target_epsilon == 8.0 and default.noise_multiplier is None
    with pytest.raises(ValueError, match="noise_multiplier"):  # neither ε nor σ: DPTrainingArguments says what to set
        recipe.make_parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path / "out"),
                                                          "--target_epsilon", "None"])


def test_classify_recipe_dp_run_with_its_own_user_column(tmp_path, toy_jsonl, tiny_bert_dir, capsys):
    """The docstring's "your own data" command in a DP run: --user_id_column reaches DPTrainer, and the result's
    config records the privacy settings the run used (not defaults of a second copy of them)."""
    rows = [json.loads(line) for line in Path(toy_jsonl).read_text().splitlines()]
    data = tmp_path / "tickets.jsonl"
    data.write_text("".join(json.dumps({"customer": r["author"], "body": r["body"], "topic": r["genre"]}) + "\n"
                            for r in rows))
    recipe = _load_recipe("classify")
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses([
        "--dataset", str(data), "--user_id_column", "customer", "--text_column", "body", "--label_column", "topic",
        "--model_name_or_path", tiny_bert_dir, "--max_length", "12", "--use_lora", "--lora_target_modules", "query",
        "value", "--output_dir", str(tmp_path / "models" / "tickets-uls"), "--results_dir", str(tmp_path),
        "--target_epsilon", "3", "--contribution_bound", "2", "--expected_batch_size", "8", "--max_steps", "2",
        "--learning_rate", "1e-2", "--per_device_train_batch_size", "16", "--noise_seed", "0",
        "--disable_tqdm", "true", "--report_to", "none", "--save_strategy", "no", "--use_cpu", "true",
    ])
    result = recipe.main(script_args, training_args)
    assert result["mechanism"] == "uls" and result["steps"] == 2
    from hf_dp.card import round_count

    # DPTrainer's users are the customers of the training split (the report rounds its count)
    assert 40 <= result["num_train_users"] < 60 and result["privacy"]["num_users"] == round_count(
        result["num_train_users"])
    saved = load_result(tmp_path / "tickets-uls.json")
    config = saved["config"]
    assert (config["target_epsilon"], config["contribution_bound"], config["expected_batch_size"]) == (3.0, 2, 8)
    assert (config["user_id_column"], config["privacy_unit"], config["sampling"]) == ("customer", "user", "uls")
    assert saved["privacy"]["contribution_bound"] == 2 and saved["privacy"]["expected_batch_size"] == 8
    assert 0 < saved["epsilon"] <= 3.0 == saved["target_epsilon"]
    assert "user-level DP, ULS" in capsys.readouterr().out  # the summary line names the mechanism by its label


@pytest.mark.slow
def test_classify_recipe_help():
    result = subprocess.run([sys.executable, str(ROOT / "recipes" / "classify.py"), "--help"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--non_private", "--use_lora", "--dataset", "--user_id_column", "--target_epsilon", "--sampling",
                 "--results_dir"):
        assert flag in result.stdout


@pytest.mark.slow
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
    assert saved is not None and saved["mechanism"] == "uls" and saved["num_eval_examples"] == 32
    assert saved["privacy"]["num_users"] == 40 and saved["epsilon"] <= 8.0
    assert (tmp_path / "models" / "uls" / "README.md").is_file()
    assert "public-only baseline" in result.stdout


def test_a_run_does_not_depend_on_what_ran_before(tmp_path, toy_jsonl, tiny_bert_dir):
    """LoRA and a new head are initialised from the run's seed: the global RNG state before the run is irrelevant."""
    metrics = []
    for draws in (0, 7):
        torch.manual_seed(123)
        torch.rand(draws)  # another run or an evaluation used the global generator
        config = toy_config(tmp_path / str(draws), tiny_bert_dir, toy_jsonl, run="seeded", use_lora=True,
                            head="linear", baseline_result=0.0)
        run_classification(config, toy_training(config, "non-private", max_steps=5))
        model, _ = load_classifier(tmp_path / str(draws) / "models" / "seeded")
        metrics.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(metrics[0], metrics[1], rtol=0, atol=0)


# ---- bad inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, match", [
    ("max_eval_examples", 0, "max_eval_examples=0: use a whole number >= 1, or None for the default."),
    ("max_train_users", -1, "max_train_users=-1: use a whole number >= 1"),
    ("max_train_users", 2.5, "max_train_users=2.5: use a whole number >= 1"),
    ("eval_fraction", 1.0, "eval_fraction=1.0: use a number strictly between 0 and 1"),
    ("max_length", 0, "max_length=0: use a whole number >= 1"),
    ("eval_batch_size", float("nan"), "eval_batch_size=nan: use a whole number >= 1"),
    ("lora_r", 0, "lora_r=0: use a whole number >= 1"),
    ("seed", -1, "seed=-1: use a whole number >= 0"),
    ("logit_scale", float("inf"), "logit_scale=inf: use a finite number > 0"),
])
def test_run_config_refuses_bad_numbers(field, value, match):
    with pytest.raises(ValueError) as error:
        ClassificationConfig(run="x", **{field: value})
    assert str(error.value).startswith(match)
    assert ClassificationConfig(run="x", max_train_users=8.0).max_train_users == 8  # an integral float is the int


@pytest.mark.parametrize("argv, match", [
    (["--max_train_users", "0"], "--max_train_users 0: use a whole number >= 1"),
    (["--max_eval_examples", "-1"], "--max_eval_examples -1: use a whole number >= 1"),
    (["--lora_r", "0"], "--lora_r 0: use a whole number >= 1"),
    (["--max_length", "0"], "--max_length 0: use a whole number >= 1"),
    (["--max_steps", "0", "--num_train_epochs", "0"], "nothing to train"),  # DPTrainingArguments' own check
])
def test_classify_recipe_refuses_bad_flags_when_parsed(tmp_path, capsys, argv, match):
    recipe = _load_recipe("classify")
    with pytest.raises(SystemExit) as exit_:
        recipe.make_parser().parse(["--output_dir", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err and err.count("error:") == 1 and "Traceback" not in err
    with pytest.raises(ValueError, match=match.split(":")[0]):  # the dataclasses refuse it from Python too
        recipe.make_parser().parse_args_into_dataclasses(["--output_dir", str(tmp_path / "out"), *argv])


@pytest.mark.parametrize("content, match", [
    (None, "no such data file or folder"),
    ("", "has no rows: give a file with one example per row"),  # was StopIteration
    ('{"author": "a", "body": null, "genre": "comedy"}\n{"author": "b", "body": "war", "genre": "history"}\n',
     "1 of 2 rows have no text (column 'body' missing or null). Drop those rows"),  # was the tokenizer's TypeError
    ('{"author": null, "body": "jest", "genre": "comedy"}\n{"author": "b", "body": "war", "genre": "history"}\n',
     "1 of 2 rows have no user id (column 'author' missing or null)"),
])
def test_classify_recipe_refuses_bad_data_before_training(tmp_path, capsys, tiny_bert_dir, content, match):
    data = tmp_path / "data" / "tickets.jsonl"
    data.parent.mkdir()
    if content is not None:
        data.write_text(content)
    results = tmp_path / "results"
    recipe = _load_recipe("classify")
    status = recipe.run_recipe(recipe.make_parser(), recipe.main, [
        "--dataset", str(data), "--user_id_column", "author", "--text_column", "body", "--label_column", "genre",
        "--model_name_or_path", tiny_bert_dir, "--output_dir", str(results / "models" / "run"),
        "--results_dir", str(results), "--max_steps", "2", "--report_to", "none", "--use_cpu", "true"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (datasets' progress bars aside)
    assert status == 2 and len(errors) == 1 and match in errors[0] and f"dataset={str(data)!r}" in errors[0]
    assert "Traceback" not in err and not results.exists()  # nothing trained, nothing written


def test_classify_recipe_refuses_bad_label_descriptions(tmp_path, capsys):
    path = tmp_path / "labels.json"
    path.write_text("{not json")
    recipe = _load_recipe("classify")
    status = recipe.run_recipe(recipe.make_parser(), recipe.main, [
        "--label_descriptions", str(path), "--output_dir", str(tmp_path / "out"), "--results_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and f"--label_descriptions {path}:" in err and "give a JSON file" in err
    assert len(err.strip().splitlines()) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["labels.json"]


def test_a_sample_of_the_users_is_stated_in_the_card_and_the_result(tmp_path, toy_jsonl, tiny_bert_dir):
    """max_train_users below the users: a fixed-size sample (replace-one adjacency), which card and result state;
    without it (or with more than there are), neither does."""
    from hf_dp.workflows.run_data import user_sample_statement

    statement = user_sample_statement(20)
    assert "fixed-size sample of 20 of the available users" in statement and "replace-one adjacency" in statement
    for run, max_users, stated in (("sampled", 20, True), ("all-users", None, False), ("more", 1000, False)):
        config = toy_config(tmp_path, tiny_bert_dir, toy_jsonl, run=run, max_train_users=max_users,
                            baseline_result=0.0, use_lora=False)
        result = run_classification(config, toy_training(config, "uls", max_steps=1))
        card = (tmp_path / result["model_dir"] / "README.md").read_text()
        assert ("fixed-size sample of 20 of the available users" in card) == stated, run
        assert ("replace-one adjacency" in card) == stated, run
        assert result["not_covered"] == ([statement] if stated else []), run
        assert load_result(tmp_path / f"{run}.json")["not_covered"] == result["not_covered"]
        assert (result["num_train_users"] == 20) == stated


def test_a_configuration_accelerate_refuses_is_one_line_and_exit_2(tmp_path, capsys):
    """An accelerate config it cannot run here (FSDP1's sync_module_states on a CPU): accelerate raises a
    RuntimeError from its own code; the recipe prints one line naming the config instead of a traceback."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    recipe = _load_recipe("classify")

    def main(script_args, training_args):
        FullyShardedDataParallelPlugin(sync_module_states=True)

    status = recipe.run_recipe(recipe.make_parser(), main, ["--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert "the accelerate configuration cannot run here: FSDP parameter initialization" in err
    assert "recipes/configs/" in err

    def buggy(script_args, training_args):  # a RuntimeError of the recipe's own still raises
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        recipe.run_recipe(recipe.make_parser(), buggy, ["--output_dir", str(tmp_path / "out")])
