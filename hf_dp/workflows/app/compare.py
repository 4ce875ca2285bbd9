"""The Compare tab: a fine-tuned run beside the public-only baseline on one text.

For a classifier, both sides' class probabilities: the baseline is the run's pretrained encoder, zero-shot by
embedding similarity to the label descriptions (what the study measures as `baseline_result`). For a causal LM, the
base model's and the run's greedy generations and next-token probabilities side by side. Loaded models are kept in a
small cache (loading is the slow part of a comparison).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

from hf_dp.formatting import format_number

from .common import AppError, error_md, mechanism_label, one_line
from .results import NON_PRIVATE, RunRecord, find_run

EXAMPLE_TEXTS = [
    "Once more unto the breach, dear friends, once more, or close the wall up with our English dead.",
    "If music be the food of love, play on; give me excess of it.",
    "Out, damned spot! out, I say! Here's the smell of the blood still.",
    "My liege, the French are landed and the nobles of the north rise in arms against the crown.",
    "Sweet lady, will you walk with me to the masque tonight? I have a jest to tell you.",
]


class _ModelCache:
    """A few loaded models, least recently used dropped first (loading is the slow part of a comparison)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key, load: Callable):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = load()
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


_MODELS = _ModelCache()


def _load_classifier(path: Path):
    from hf_dp.workflows.tasks.classifier_models import load_classifier

    if not path.is_dir():
        raise AppError(f"The run's model folder {path} does not exist (was the results folder moved?).")
    model, tokenizer = load_classifier(path)
    return model.eval(), tokenizer


def _label_names(run: RunRecord, model=None) -> list[str]:
    names = run.result.get("label_names") or getattr(model, "label_names", None)
    if names:
        return [str(n) for n in names]
    if model is not None and getattr(model.config, "id2label", None):
        return [model.config.id2label[i] for i in sorted(model.config.id2label)]
    raise AppError(f"Run {run.name} does not record its label names.")


def _zero_shot(run: RunRecord, label_names: Sequence[str]):
    """The run's public-only baseline: its pretrained encoder, zero-shot against the label descriptions."""
    from hf_dp.workflows.tasks.classification import LABEL_DESCRIPTIONS
    from hf_dp.workflows.tasks.classifier_models import EmbeddingClassifier

    config = run.result.get("config") or {}
    model_path = config.get("model_name_or_path")
    descriptions = config.get("label_descriptions")
    if descriptions is None and set(label_names) <= set(LABEL_DESCRIPTIONS):
        descriptions = LABEL_DESCRIPTIONS
    settings = dict(max_length=int(config.get("max_length") or 128),
                    logit_scale=float(config.get("logit_scale") or 20.0))
    key = ("zero-shot", model_path, json.dumps(descriptions, sort_keys=True), tuple(label_names),
           tuple(sorted(settings.items())))
    return _MODELS.get(key, lambda: EmbeddingClassifier.from_descriptions(model_path, label_names, descriptions,
                                                                          **settings))


def _probabilities(model, tokenizer, text: str, max_length: int) -> list[float]:
    import torch

    with torch.no_grad():
        encoded = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
        return torch.softmax(model(**encoded).logits[0].float(), dim=-1).tolist()


def _classify(run: RunRecord, text: str) -> tuple[dict, dict]:
    path = run.model_path
    if path is None:
        raise AppError(f"{run.name} is the public-only baseline (no fine-tuned model): pick a fine-tuned run.")
    model, tokenizer = _MODELS.get(("classifier", str(path.resolve())), lambda: _load_classifier(path))
    names = _label_names(run, model)
    max_length = int((run.result.get("config") or {}).get("max_length") or 128)
    dp = dict(zip(names, _probabilities(model, tokenizer, text, max_length)))
    zero_shot = _zero_shot(run, names)
    baseline = dict(zip(names, _probabilities(zero_shot, zero_shot.tokenizer, text, max_length)))
    return baseline, dp


def _load_causal_lm(path_or_name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path_or_name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path_or_name)
    return model, tokenizer


def _generate(model, tokenizer, text: str, max_new_tokens: int) -> tuple[str, dict]:
    import torch

    encoded = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits[0, -1].float()
        top = torch.topk(torch.softmax(logits, dim=-1), k=min(5, logits.shape[-1]))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    continuation = tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
    next_tokens = {}
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        token = repr(tokenizer.decode([i]))
        next_tokens[token] = next_tokens.get(token, 0.0) + float(p)
    return continuation, next_tokens


def _compare_causal_lm(run: RunRecord, text: str, max_new_tokens: int = 30):
    path = run.model_path
    if path is None or not path.is_dir():
        raise AppError(f"{run.name} has no saved model to generate with.")
    config = run.result.get("config") or {}
    base = config.get("model_name_or_path") or run.result.get("base_model")
    try:
        base_model, base_tokenizer = _MODELS.get(("lm", str(base)), lambda: _load_causal_lm(str(base)))
    except Exception as error:
        raise AppError(f"The base model {base!r} is not available offline ({one_line(error)}).") from error
    dp_model, dp_tokenizer = _MODELS.get(("lm", str(path.resolve())), lambda: _load_causal_lm(str(path)))
    base_text, base_next = _generate(base_model, base_tokenizer, text, max_new_tokens)
    dp_text, dp_next = _generate(dp_model, dp_tokenizer, text, max_new_tokens)
    return base_next, dp_next, base_text, dp_text


def compare_view(results_dir, run_name: str | None, text: str | None) -> dict:
    """The Compare tab for one run and one text.

    Returns:
        `dict` with `baseline` and `dp` (label -> probability; next token -> probability for causal LMs),
        `baseline_text` and `dp_text` (generations, causal LMs only), `causal_lm`, `header` (markdown) and
        `error` (one line, or `""`).
    """
    out = {"baseline": None, "dp": None, "baseline_text": "", "dp_text": "", "causal_lm": False,
           "header": "", "error": ""}
    try:
        run = find_run(results_dir, run_name)
        if not text or not text.strip():
            raise AppError("Type or pick a text to compare.")
        text = text.strip()
        if run.is_causal_lm:
            out["causal_lm"] = True
            out["baseline"], out["dp"], out["baseline_text"], out["dp_text"] = _compare_causal_lm(run, text)
        else:
            out["baseline"], out["dp"] = _classify(run, text)
        out["header"] = compare_header(run)
    except Exception as error:
        out["error"] = error_md(error)
    return out


def compare_header(run: RunRecord) -> str:
    """The line above the comparison: the run, its mechanism and guarantee, its `eval_result` and the baseline's."""
    result = run.result
    if run.mechanism == NON_PRIVATE:
        guarantee = "no privacy guarantee"
    else:
        unit = (result.get("privacy") or {}).get("privacy_unit", "?")
        guarantee = (f"({format_number(result.get('epsilon'), '.3g')}, {format_number(result.get('delta'), '.2g')})"
                     f"-DP, {unit}-level")
    return (f"**{run.name}**: {mechanism_label(run.mechanism)}, {guarantee}; test {run.metric_name} "
            f"{format_number(result.get('eval_result'), '.3f')} vs public-only baseline "
            f"{format_number(result.get('baseline_result'), '.3f')}.")
