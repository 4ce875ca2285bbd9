"""The user-facing audit: it sees what the training really does, and keeps canaries out of what is released.

End to end on a tiny causal LM (built from a config) and users made in code: canaries are ordinary users of a
DPTrainer run, the audit's lower bound is high when the noise is negligible, stays at or below ε = 1 for an honest
run at ε = 1, and exceeds the claimed ε when the noise is secretly shrunk 100-fold while the ledger still says 1.
"""

from __future__ import annotations

import json
import math
import zlib

import datasets
import numpy as np
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM, Trainer

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.audit import (
    AuditReport,
    Canaries,
    audit_report,
    audit_training,
    gradient_alignment_scores,
    is_canary_user,
    make_canaries,
    remove_canaries,
)
from hf_dp.audit.record import AUDIT_FILE, check_audit_record
from hf_dp.audit.run import AUDIT_DIR, audit_guesses, choose_score
from hf_dp.audit.scoring import row_losses, trainable_parameters

VOCAB = 1024
_WORDS = "the a user said order refund please thanks hello account password shipping late early good bad".split()


def _real_rows(users: int = 200, seed: int = 0, labels: bool = False) -> datasets.Dataset:
    """Users with 1-3 rows of 8 words from a small list (canary words come from another list)."""
    rng = np.random.default_rng(seed)
    rows = {"user_id": [], "text": [], "label": []}
    for user in range(users):
        for _ in range(int(rng.integers(1, 4))):
            words = rng.choice(_WORDS, size=8)
            rows["user_id"].append(f"user{user}")
            rows["text"].append(" ".join(words))
            rows["label"].append(_WORDS.index(words[0]) % 3)
    if not labels:
        del rows["label"]
        return datasets.Dataset.from_dict(rows)
    features = datasets.Features({"user_id": datasets.Value("string"), "text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(num_classes=3)})
    return datasets.Dataset.from_dict(rows, features=features)


def _token(word: str) -> int:
    return 2 + zlib.crc32(word.encode()) % (VOCAB - 2)


def _tokenize(dataset: datasets.Dataset) -> datasets.Dataset:
    """A hashing word tokenizer: BOS (1) + one id per word; a canary's 64-bit marker is a word of its own."""
    def encode(batch):
        out = {"input_ids": [[1] + [_token(w) for w in text.split()][:15] for text in batch["text"]]}
        if "label" in batch:
            out["labels"] = batch["label"]
        return out

    return dataset.map(encode, batched=True, remove_columns=[c for c in ("text", "label") if c in dataset.column_names])


def _collate(rows: list[dict]) -> dict:
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    if "labels" in rows[0] and not isinstance(rows[0]["labels"], list):
        labels = torch.tensor([r["labels"] for r in rows])
    else:
        labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _tiny_lm(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _tiny_classifier(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=3)
    return BertForSequenceClassification(config)


def _args(tmp_path, **overrides) -> DPTrainingArguments:
    # 200 real users + ~128 included canaries, 64 users per step (q ≈ 0.2), 100 steps: each included canary is
    # sampled about 20 times. δ fixed at 1e-5 (the default 1/(10·users) ≈ 3e-4 is large for an audit of m = 256).
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=100, expected_batch_size=64,
                    per_device_train_batch_size=64, learning_rate=1e-2, contribution_bound=1, target_delta=1e-5,
                    noise_seed=1, report_to=[], logging_steps=1000, save_strategy="no", use_cpu=True,
                    disable_tqdm=True)
    settings.update(overrides)
    return DPTrainingArguments(**settings)


def _audit(tmp_path, *, canaries: int = 256, score: str = "auto", seed: int = 3, **overrides) -> AuditReport:
    def make_trainer(rows):
        return DPTrainer(model=_tiny_lm(), args=_args(tmp_path, **overrides), train_dataset=rows,
                         data_collator=_collate)

    return audit_training(make_trainer, _real_rows(), canaries=canaries, seed=seed, tokenize=_tokenize, score=score)


# ---- the three end-to-end checks ----------------------------------------------------------------------------


def _shrink_noise(monkeypatch, factor: float) -> list:
    """The training step's noise `factor` times what the ledger records (a broken step); returns the σ's seen."""
    import hf_dp.step

    honest, calls = hf_dp.step.add_noise, []

    def shrunk(params, *, noise_multiplier, **kwargs):
        calls.append(noise_multiplier)
        honest(params, noise_multiplier=noise_multiplier * factor, **kwargs)

    monkeypatch.setattr(hf_dp.step, "add_noise", shrunk)
    return calls


@pytest.mark.slow
def test_negligible_noise_gives_a_high_lower_bound(tmp_path, monkeypatch):
    """Noise 1,000 times below what ε = 8 needs (a plan that states so little noise is refused: the sampler's
    δ would be unbounded): the black-box audit sees it."""
    calls = _shrink_noise(monkeypatch, 1e-3)
    report = _audit(tmp_path, target_epsilon=8.0)
    assert calls and report.score == "black-box" and report.epsilon_lower_bound > 1.0, report.to_dict()
    assert report.epsilon_upper_bound <= 8.0


@pytest.mark.slow
def test_white_box_score_sees_negligible_noise_too(tmp_path, monkeypatch):
    _shrink_noise(monkeypatch, 1e-3)
    report = _audit(tmp_path, score="white-box", target_epsilon=8.0)
    assert report.score == "white-box" and report.epsilon_lower_bound > 0.0, report.to_dict()


@pytest.mark.slow
def test_trained_loss_score_sees_negligible_noise(tmp_path, monkeypatch):
    _shrink_noise(monkeypatch, 1e-3)
    report = _audit(tmp_path, score="trained-loss", target_epsilon=8.0)
    assert report.score == "trained-loss" and report.epsilon_lower_bound > 1.0, report.to_dict()
    assert "loss under the trained model alone" in report.card_section()


@pytest.mark.slow
def test_dp_at_epsilon_one_stays_at_most_one(tmp_path):
    report = _audit(tmp_path, target_epsilon=1.0)
    assert report.epsilon_upper_bound <= 1.0
    assert report.epsilon_lower_bound <= 1.0, report.to_dict()
    assert not report.exceeds_upper_bound


@pytest.mark.slow
def test_noise_shrunk_behind_the_ledger_is_caught(tmp_path, monkeypatch):
    """A broken training step: noise 100x smaller than the ledger records. The ledger still says ε ≤ 1."""
    calls = _shrink_noise(monkeypatch, 1e-2)
    report = _audit(tmp_path, target_epsilon=1.0)
    assert calls, "the trainer no longer adds noise through hf_dp.step.add_noise: update this test's patch"
    assert report.epsilon_upper_bound <= 1.0  # what the ledger claims
    assert report.exceeds_upper_bound and report.epsilon_lower_bound > 1.0, report.to_dict()
    assert "The audit FAILED: this lower bound exceeds the proven" in report.card_section() and report.failed


# ---- canaries: same path as users, kept out of what is counted and released --------------------------------


def test_canaries_are_users_excluded_from_counts_and_the_record_is_never_uploaded(tmp_path):
    from hf_dp.hub import IGNORE_PATTERNS, PrivacyCardError, check_privacy_card

    seen = {}

    def make_trainer(rows):
        seen["rows"] = rows
        trainer = DPTrainer(model=_tiny_lm(), args=_args(tmp_path, max_steps=2, target_epsilon=8.0, noise_seed=None),
                            train_dataset=rows, data_collator=_collate)
        seen["trainer"] = trainer
        return trainer

    real = _real_rows()
    report = audit_training(make_trainer, real, canaries=16, seed=5, tokenize=_tokenize, score="white-box")
    out = tmp_path / "out"
    record = Canaries.load(out / AUDIT_DIR / "canaries.json")
    assert len(record) == 16 and report.steinke.included == int(record.included.sum())
    assert (report.privacy_unit, report.mechanism, report.score) == ("user", "uls", "white-box")

    # The trainer got the real rows plus exactly the included canaries, as users of their own.
    trained_users = set(seen["rows"]["user_id"])
    included_ids = {record.user_ids[i] for i in np.flatnonzero(record.included)}
    assert {u for u in trained_users if is_canary_user(u)} == included_ids
    clean = remove_canaries(seen["rows"])
    assert len(clean) == len(real) and set(clean["user_id"]) == set(real["user_id"])
    assert "included" not in seen["rows"].column_names  # the coins never reach the trainer

    # The record and the report live under _audit/: never uploaded by `hf-dp publish` nor Trainer.push_to_hub.
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert f"{AUDIT_DIR}/canaries.json" in files and f"{AUDIT_DIR}/report.json" in files
    for patterns in (IGNORE_PATTERNS, ["_*", "checkpoint-*"]):
        uploaded = list(filter_repo_objects(files, ignore_patterns=patterns))
        assert "README.md" in uploaded and not any(name.startswith(AUDIT_DIR) for name in uploaded)
    assert json.loads((out / AUDIT_DIR / "report.json").read_text()) == report.to_dict()

    # The card gets the section and the report beside it (uploaded with the card); `hf-dp publish` accepts it,
    # rewriting replaces it. A claim put inside the section, or the report removed, is refused.
    report.write_to_card(out, audited_model=True)
    report.write_to_card(out, audited_model=True)
    card = (out / "README.md").read_text()
    assert card.count("## Empirical audit") == 1 and "this model's own training run" in card
    assert json.loads((out / AUDIT_FILE).read_text()) == {**report.to_dict(), "audited_model": True}
    assert AUDIT_FILE in list(filter_repo_objects([AUDIT_FILE], ignore_patterns=IGNORE_PATTERNS))
    check_privacy_card(out)
    claimed = card.replace("| Audit | Value |", "This model is (0.1, 1e-9)-DP.\n| Audit | Value |")
    (out / "README.md").write_text(claimed)
    with pytest.raises(PrivacyCardError, match="section differs .* it says 'This model is"):
        check_privacy_card(out)
    (out / "README.md").write_text(card)
    (out / AUDIT_FILE).unlink()
    with pytest.raises(PrivacyCardError, match="no audit report beside it"):
        check_privacy_card(out)


def test_remove_canaries_keeps_evaluation_and_baseline_clean():
    real = _real_rows(users=30)
    canaries = make_canaries(10, 2, seed=0)
    mixed = datasets.concatenate_datasets([real, datasets.Dataset.from_list(
        [row for i in range(10) for row in canaries.rows_of(i)], features=real.features)])
    cleaned = remove_canaries(mixed)
    assert cleaned["text"] == real["text"] and not any(is_canary_user(u) for u in cleaned["user_id"])


# ---- white-box score -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_model", [_tiny_lm, _tiny_classifier], ids=["causal-lm", "classifier"])
def test_gradient_alignment_is_the_directional_derivative(make_model):
    """−<Δ, ∇L_i(θ_0)>/‖∇L_i‖ equals the loss drop along Δ over ‖∇L_i‖ (central finite differences, in float64),
    and the model comes back at θ_T, in training mode."""
    model = make_model().double()
    labelled = make_model is _tiny_classifier
    canaries = make_canaries(6, 2, seed=1, **({"label_column": "label", "num_labels": 3} if labelled else {}))
    rows = _tokenize(datasets.Dataset.from_list([r for i in range(6) for r in canaries.rows_of(i)]))
    rows = rows.remove_columns("user_id")
    per_canary = [[rows[2 * i], rows[2 * i + 1]] for i in range(6)]
    params = trainable_parameters(model)
    initial = {n: p.detach().clone() for n, p in params.items()}
    generator = torch.Generator().manual_seed(0)
    step = {n: 1e-4 * torch.randn(p.shape, generator=generator, dtype=p.dtype) for n, p in initial.items()}

    def move(scale):
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(initial[name] + scale * step[name])

    move(1.0)
    model.train()
    scores = gradient_alignment_scores(model, initial, per_canary, _collate)
    assert model.training and all(torch.equal(p, initial[n] + step[n]) for n, p in params.items())

    model.eval()
    for i, canary in enumerate(per_canary):
        batch = _collate(canary)
        labels = batch.pop("labels")

        def loss_at(scale):
            move(scale)
            with torch.no_grad():
                return float(row_losses(model(**batch).logits.double(), labels).mean())

        move(0.0)
        loss = row_losses(model(**batch).logits.double(), labels).mean()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))
        drop = (loss_at(-1.0) - loss_at(1.0)) / 2  # −<Δ, ∇L> up to third-order terms
        assert scores[i] == pytest.approx(drop / norm, rel=1e-3, abs=1e-12)


def test_gradient_alignment_refuses_other_parameters():
    model = _tiny_lm()
    with pytest.raises(ValueError, match="differ from initial_parameters"):
        gradient_alignment_scores(model, {"other.weight": torch.zeros(1)}, [], _collate)


def test_auto_score_is_black_box():
    assert choose_score("auto") == "black-box"
    assert choose_score("white-box") == "white-box" and choose_score("black-box") == "black-box"
    with pytest.raises(ValueError, match="score="):
        choose_score("grey-box")


# ---- the report ------------------------------------------------------------------------------------------------


def _separated(m=256, seed=0, flip=0.0):
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    scores = (included ^ (rng.random(m) < flip)).astype(float) + 1e-9 * rng.random(m)
    return scores, included


def test_report_dict_round_trip_and_card_section():
    scores, included = _separated(flip=0.1)
    report = audit_report(scores, included, delta=1e-5, confidence=0.95, rows_per_canary=2, score="black-box",
                          epsilon_upper_bound=8.0, privacy_unit="user", mechanism="uls")
    assert 0 < report.epsilon_lower_bound < report.epsilon_ceiling < 8 and not report.exceeds_upper_bound
    assert report.fdp_epsilon_lower_bound > 0 and report.steinke.hypotheses == len(audit_guesses(256))
    as_dict = json.loads(json.dumps(report.to_dict()))
    assert AuditReport.from_dict(as_dict) == report
    assert as_dict["canaries"] == 256 and as_dict["rows_per_canary"] == 2 and as_dict["confidence"] == 0.95

    section = report.card_section()
    assert section.startswith("## Empirical audit\n")
    lower = f"{math.floor(report.epsilon_lower_bound * 100) / 100:.2f}"
    for text in (f"**{lower}**", "| Canary users m; rows per canary k | 256; 2 |", "95 %", "8.00",
                 "does not tighten the guarantee", "well below the proven ε is expected",
                 "not counted in the evaluation or in the public-only baseline", "a separate training run"):
        assert text in section, text
    assert "Warning" not in section


def test_report_flags_a_lower_bound_above_the_claim():
    scores, included = _separated()
    report = audit_report(scores, included, delta=1e-5, epsilon_upper_bound=0.5)
    assert report.exceeds_upper_bound and report.failed
    lower = f"{math.floor(report.epsilon_lower_bound * 100) / 100:.2f}"
    loud = f"the audit FAILED: lower bound {lower} > proven ε 0.50: the implementation is broken"
    assert report.verdict.startswith(loud)
    section = report.card_section()
    assert section.splitlines()[2].startswith(f"**WARNING: {loud}")  # first, above the table
    assert "The audit FAILED: this lower bound exceeds the proven ε = 0.50" in section
    as_dict = report.to_dict()
    assert as_dict["audit_failed"] is True and as_dict["verdict"].startswith(loud)
    # The same guesses against a claim they do not refute: passed, nothing loud.
    passed = audit_report(scores, included, delta=1e-5, epsilon_upper_bound=report.epsilon_lower_bound + 0.01)
    assert not passed.failed and "FAILED" not in passed.card_section() and passed.verdict.startswith("the audit passed")
    assert passed.to_dict()["audit_failed"] is False
    non_private = audit_report(scores, included, delta=1e-5)
    assert not non_private.exceeds_upper_bound and "∞ (trained without DP" in non_private.card_section()
    pure = audit_report(scores, included, delta=0.0)
    assert pure.fdp is None and "f-DP" not in pure.card_section() and "f-DP" not in report.card_section()
    chance = audit_report(np.random.default_rng(1).normal(size=256), included, delta=1e-5, epsilon_upper_bound=1.0)
    assert chance.epsilon_lower_bound == 0 and "no better than chance" in chance.card_section()


def _genuine_reports():
    """Reports `audit_report` writes: passed, failed, without DP, at δ = 0, at chance (bound 0), with guesses of
    one's own, with 2 and with 1,000 canaries."""
    scores, included = _separated(flip=0.1)
    exact, coins = _separated()
    chance = np.random.default_rng(1).normal(size=256)
    few = np.array([True, False])
    many, many_coins = _separated(m=1000, flip=0.3)
    return [
        audit_report(scores, included, delta=1e-5, epsilon_upper_bound=8.0, privacy_unit="user", mechanism="uls"),
        audit_report(exact, coins, delta=1e-5, epsilon_upper_bound=0.5, privacy_unit="user", mechanism="uls"),
        audit_report(scores, included, delta=1e-5, mechanism="non-private"),
        audit_report(scores, included, delta=0.0, epsilon_upper_bound=2.0, privacy_unit="example"),
        audit_report(chance, included, delta=1e-5, epsilon_upper_bound=1.0, score="trained-loss"),
        audit_report(scores, included, delta=1e-3, confidence=0.5, guesses=[(10, 0), (30, 30)], score="white-box"),
        audit_report(few.astype(float), few, delta=1e-5, epsilon_upper_bound=1.0),
        audit_report(many, many_coins, delta=1e-6, epsilon_upper_bound=4.0),
    ]


def test_every_genuine_audit_record_passes_its_own_check():
    """What write_to_card saves, read back: accepted, the same report and flag (a check that refused true reports
    would refuse every audited card)."""
    reports = _genuine_reports()
    assert reports[1].failed and reports[4].epsilon_lower_bound == 0 and reports[3].fdp is None
    for i, report in enumerate(reports):
        record = json.loads(json.dumps({**report.to_dict(), "audited_model": bool(i % 2)}))
        assert check_audit_record(record) == (report, bool(i % 2))


def _edited(report, audited_model=True, **changes):
    record = json.loads(json.dumps({**report.to_dict(), "audited_model": audited_model}))
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            record[outer] = {**record[outer], inner: value}
        else:
            record[key] = value
    return record


@pytest.mark.parametrize("changes, match", [
    ({"verdict": "the audit passed: lower bound 3.16 <= proven ε 8.00 (ceiling 3.16)"}, "says verdict = "),
    ({"audit_failed": False}, "says audit_failed = False, but its own figures give True"),
    ({"epsilon_lower_bound": 0.0}, "says epsilon_lower_bound = 0.0"),
    ({"steinke.epsilon_lower_bound": 0.0, "epsilon_lower_bound": 0.0, "verdict": None, "audit_failed": False,
      "exceeds_upper_bound": False}, "says (audit_failed|exceeds_upper_bound|verdict)"),
    ({"steinke.correct": 300, "correct": 300}, "has counts no audit gives"),
    ({"steinke.included": 300, "included": 300}, "has counts no audit gives"),
    ({"steinke.canaries": 255.5, "canaries": 255.5}, "has canaries = 255.5, which no audit writes"),
    ({"steinke.delta": float("nan"), "delta": float("nan")}, "delta = nan"),
    ({"steinke.method": "mahloujifar-melis-chaudhuri-2024-gaussian"}, "method 'mahloujifar"),
    ({"score": "auto"}, "has score = 'auto'"),
    ({"audited_model": None}, "records audited_model = None"),
    ({"steinke": None}, "is not one AuditReport.to_dict wrote"),
], ids=["verdict", "audit-failed", "top-level-bound", "bound-and-verdict", "correct", "included", "canaries", "delta",
        "method", "score", "flag", "no-result"])
def test_an_edited_audit_record_is_refused(changes, match):
    """A failed audit's record (lower bound 3.16 > ε 0.5) edited by hand: each figure that does not follow from the
    others is named."""
    failed = _genuine_reports()[1]
    with pytest.raises(ValueError, match=match) as error:
        check_audit_record(_edited(failed, **changes))
    assert "\n" not in str(error.value) and AUDIT_FILE in str(error.value)


def test_write_to_card_needs_the_card_first_and_writes_nothing_without_it(tmp_path):
    report = _genuine_reports()[0]
    with pytest.raises(FileNotFoundError, match="write the privacy card first"):
        report.write_to_card(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_audit_guesses_are_few_and_valid():
    for m in (2, 3, 16, 256, 1000):
        pairs = audit_guesses(m)
        assert 1 <= len(pairs) <= 9 and all(1 <= kp + km <= m and kp >= 1 for kp, km in pairs)
    # With 9 pairs a perfect guesser can show ε > 2.5 at m = 256 and δ = 1e-4 (48 pairs leave about 1.5).
    _, included = _separated()
    perfect = audit_report(included.astype(float), included, delta=1e-4)
    assert perfect.epsilon_lower_bound == perfect.epsilon_ceiling > 2.5


def test_many_memorised_canaries_refute_two_with_the_wide_in_guesses():
    """512 canaries, 262 included, the top 102 scores holding 98 included (the rest shuffled): the 20 % "in" guess
    refutes ε = 2 at δ = 1e-5, where the other pairs stop at about 1.6 (the fact behind the 20 and 25 % pairs)."""
    rng = np.random.default_rng(0)
    included = np.zeros(512, dtype=bool)
    included[:262] = True
    scores = rng.normal(size=512)
    top = np.r_[np.arange(98), 262 + np.arange(4)]
    scores[top] = 100 + rng.permutation(len(top))
    report = audit_report(scores, included, delta=1e-5)
    assert report.epsilon_lower_bound > 2.0 and tuple(report.steinke.guesses) == (102, 0), report.to_dict()
    narrow = audit_report(scores, included, delta=1e-5, guesses=[p for p in audit_guesses(512) if p[0] < 102])
    assert narrow.epsilon_lower_bound < 1.7


# ---- refusals, all before any training --------------------------------------------------------------------------


def _never_called(rows):
    raise AssertionError("make_trainer should not be called")


@pytest.mark.parametrize("kwargs,match", [
    (dict(confidence=1.0), "confidence"),
    (dict(delta=1.5), "delta"),
    (dict(score="grey-box"), "score="),
    (dict(canaries=1), "num_canaries"),
    (dict(text_column="body"), "no column 'body'"),
])
def test_bad_settings_fail_before_the_trainer(kwargs, match):
    with pytest.raises(ValueError, match=match):
        audit_training(_never_called, _real_rows(users=10), tokenize=_tokenize, **kwargs)


def test_extra_columns_are_refused():
    rows = _real_rows(users=10).add_column("extra", [0] * len(_real_rows(users=10)))
    rows = rows.add_column("more", ["x"] * len(rows))
    with pytest.raises(ValueError, match="besides user and text"):
        audit_training(_never_called, rows, tokenize=_tokenize)


def test_chat_audit_needs_prompt_and_completion_only():
    chat = datasets.Dataset.from_dict({
        "user_id": ["a", "b"],
        "prompt": [[{"role": "user", "content": "hi"}]] * 2,
        "completion": [[{"role": "assistant", "content": "hello"}]] * 2,
    })
    with pytest.raises(ValueError, match="no column 'question'"):
        audit_training(_never_called, chat, text_column="completion", prompt_column="question")
    with pytest.raises(ValueError, match=r"columns \['play'\] besides user, prompt and completion"):
        audit_training(_never_called, chat.add_column("play", ["x", "y"]), text_column="completion",
                       prompt_column="prompt")


def test_refusals_that_need_the_trainer(tmp_path):
    def dp(**overrides):
        return lambda rows: DPTrainer(model=_tiny_lm(), args=_args(tmp_path, max_steps=2, **overrides),
                                      train_dataset=rows, data_collator=_collate)

    with pytest.raises(ValueError, match="privacy_unit='example'"):
        audit_training(dp(privacy_unit="example"), _real_rows(), canaries=8, rows_per_canary=2, tokenize=_tokenize)
    with pytest.raises(ValueError, match="exceeds the contribution bound G = 1"):
        audit_training(dp(), _real_rows(), canaries=8, rows_per_canary=2, tokenize=_tokenize)
    with pytest.raises(ValueError, match="'author'"):
        audit_training(dp(user_id_column="author"), _real_rows(), canaries=8, tokenize=_tokenize)

    def plain(rows):
        from transformers import TrainingArguments

        args = TrainingArguments(str(tmp_path / "plain"), max_steps=1, report_to=[], use_cpu=True)
        return Trainer(model=_tiny_lm(), args=args, train_dataset=rows, data_collator=_collate)

    with pytest.raises(ValueError, match="pass delta="):
        audit_training(plain, _real_rows(), canaries=8, tokenize=_tokenize)
    assert not (tmp_path / "out" / AUDIT_DIR).exists()  # nothing recorded for a refused audit


def test_tokenize_must_map_rows_one_to_one():
    with pytest.raises(ValueError, match="one to one"):
        audit_training(_never_called, _real_rows(users=10), canaries=4, tokenize=lambda d: _tokenize(d).select([0]))
