"""The Compare tab: a fine-tuned run beside the public-only baseline on one text.

For a classifier, both sides' class probabilities: the baseline is the run's pretrained encoder, zero-shot by
embedding similarity to the label descriptions (what the study measures as `baseline_result`).

For a language model (a result `task` of [`~hf_dp.workflows.app.results.LANGUAGE_MODEL_TASKS`]: `chat-sft` or
`causal-lm`), generations side by side ([`language_model_columns`]): the public-only baseline (the untouched base
model the run started from), the selected run, and the non-private run of the same task when the folder has one,
each headed with its guarantee and its test metric. A chat run's prompt is sent as a user message through the chat
template with the generation prompt (as it was trained); a plain causal LM's as plain text. Every column decodes
alike ([`Decoding`]): sampling at a fixed temperature and top-p after `torch.manual_seed(seed)`, so a seed gives the
same texts on every click and the columns differ only by their weights. Generations are post-processing of the
models: they spend no ε.

Loaded models stay loaded across clicks: a cache keyed by the model's folder (and its files' modification times,
so a folder written again is loaded again) holds the three models of a comparison and a classifier's two; picking
a run in the page loads its models in the background ([`preload`]). A column's text is generated once per model,
prompt and decoding and kept ([`generate_text`] is deterministic for a seed), so clicking again answers at once;
[`compare_steps`] yields the comparison column by column, for a page that shows each column's progress. A
Train-tab run may hold a LoRA adapter instead of a merged model (`adapter_config.json`): it is loaded onto its base
model and merged in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

from hf_dp.formatting import format_number
from hf_dp.command_line import check_numbers
from hf_dp.vocabulary import lower_is_better

from .common import AppError, error_md, mechanism_label, one_line
from .results import NON_PRIVATE, RunRecord, find_run, list_runs

EXAMPLE_TEXTS = [
    "Once more unto the breach, dear friends, once more, or close the wall up with our English dead.",
    "If music be the food of love, play on; give me excess of it.",
    "Out, damned spot! out, I say! Here's the smell of the blood still.",
    "My liege, the French are landed and the nobles of the north rise in arms against the crown.",
    "Sweet lady, will you walk with me to the masque tonight? I have a jest to tell you.",
]

# The Compare tab's column headings for a classifier (a language model's come with its columns).
CLASSIFIER_HEADINGS = ("#### Public-only baseline (no private data)", "#### Fine-tuned model")
# The label of the Compare tab's text box, by the kind of run picked.
TEXT_LABELS = {"classifier": "text: both models give its class probabilities",
               "generative": "prompt: each model continues it",
               "chat": "prompt: each model replies to it (sent as a user message)"}


class _ModelCache:
    """Loaded models, least recently used dropped first beyond `size`; one load per key at a time (a click that
    comes while the page's [`preload`] loads the same model waits for it instead of loading it twice)."""

    def __init__(self, size: int = 6):
        self.size = size
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict = {}

    def get(self, key, load: Callable):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
            key_lock = self.loading.setdefault(key, threading.Lock())
        with key_lock:
            with self.lock:
                if key in self.items:
                    self.items.move_to_end(key)
                    return self.items[key]
            value = load()
            with self.lock:
                self.items[key] = value
                self.loading.pop(key, None)
                while len(self.items) > self.size:
                    self.items.popitem(last=False)
            return value

    def __contains__(self, key) -> bool:
        with self.lock:
            return key in self.items

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


_MODELS = _ModelCache()
_TEXTS: OrderedDict = OrderedDict()  # (model key, prompt, prompting, decoding) -> generated text
_TEXTS_SIZE = 256
MAX_NEW_TOKENS = 200
_GENERATING = threading.Lock()  # one seeded generation at a time: the seed is torch's global one


def folder_key(path) -> tuple:
    """A cache key for the model saved in `path`: the resolved folder and the modification times of its files (a
    folder saved again gets a new key, so a stale model is never shown)."""
    folder = Path(path).resolve()
    stamps = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file()))
    return (str(folder), stamps)


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


def _load_causal_lm(path_or_name: str, base: str | None = None):
    """(model, tokenizer) from a folder or a Hub id in the local cache. A LoRA adapter folder (`adapter_config.json`,
    what the Train tab saves) is loaded onto `base` (else the base its config names) and merged in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = Path(str(path_or_name)) / "adapter_config.json"
    if adapter.is_file():
        from peft import PeftModel

        base = base or json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base:
            raise AppError(f"The adapter in {adapter.parent} does not name its base model.")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(path_or_name))
        model = model.merge_and_unload().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path_or_name).eval()
    tokenizer = AutoTokenizer.from_pretrained(path_or_name)
    return model, tokenizer


def _model_key(path_or_name) -> tuple:
    path = Path(str(path_or_name))
    return ("lm", *folder_key(path)) if path.is_dir() else ("lm", str(path_or_name))


def _language_model(path_or_name, what: str, base: str | None = None):
    """A cached (model, tokenizer) from a folder (or a Hub id in the local cache); a one-line [`AppError`] when the
    folder is missing or does not load. `base`: the base model of an adapter folder."""
    path = Path(str(path_or_name))
    if isinstance(path_or_name, Path) or path.is_absolute() or str(path_or_name).startswith("."):
        if not path.is_dir():
            raise AppError(f"The {what} folder {path} does not exist (was the results folder or the cache moved?).")
    try:
        return _MODELS.get(_model_key(path_or_name), lambda: _load_causal_lm(str(path_or_name), base))
    except AppError:
        raise
    except Exception as error:
        raise AppError(f"The {what} {str(path_or_name)!r} does not load offline ({one_line(error)}).") from error


@dataclasses.dataclass
class Decoding:
    """How every column of a language-model comparison decodes: `torch.manual_seed(seed)`, then sampling at
    `temperature` (0: greedy) with nucleus `top_p`, at most `max_new_tokens` tokens.

    Raises:
        AppError: a seed that is not a whole number >= 0, `max_new_tokens` outside 1..[`MAX_NEW_TOKENS`],
            `temperature` outside 0..10 or `top_p` outside (0, 1].
    """

    seed: int = 0
    max_new_tokens: int = 40
    temperature: float = 0.7
    top_p: float = 0.9

    def __post_init__(self):
        try:
            check_numbers(self, {"seed": "int>=0", "max_new_tokens": "int>=1"}, flags=False)
        except ValueError as error:
            raise AppError(str(error)) from None
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise AppError(f"max_new_tokens={self.max_new_tokens}: use at most {MAX_NEW_TOKENS}.")
        for name, low, high, low_open in (("temperature", 0.0, 10.0, False), ("top_p", 0.0, 1.0, True)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value > high or value < low or (low_open and value == low):
                wanted = f"a number in ({low:g}, {high:g}]" if low_open else f"a number from {low:g} to {high:g}"
                raise AppError(f"{name}={value!r}: use {wanted}.")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)

    def key(self) -> tuple:
        """What a generation depends on besides the model and the prompt."""
        return (self.seed, self.max_new_tokens, self.temperature, self.top_p)

    def describe(self, chat: bool, system_prompt: str | None = None) -> str:
        """The decoding in words, as the page states it under the columns."""
        how = ("greedy decoding" if self.temperature == 0 else
               f"sampling at temperature {self.temperature:g}, top-p {self.top_p:g}, seed {self.seed}")
        prompt = ("given as plain text (a causal LM: no chat template)" if not chat
                  else "sent as a user message through the chat template"
                  + (f", after the run's system prompt “{system_prompt}”" if system_prompt else ""))
        return (f"Every column: {how}, at most {self.max_new_tokens} new tokens (the same seed gives the same texts); "
                f"the prompt is {prompt}.")


def prompt_inputs(tokenizer, prompt: str, *, chat: bool, system_prompt: str | None = None) -> dict:
    """The model inputs for `prompt`: a user message (after a `system_prompt` message, when given) through the chat
    template with the generation prompt when `chat`, else the plain text."""
    if not chat:
        return dict(tokenizer([prompt], return_tensors="pt"))
    if not getattr(tokenizer, "chat_template", None):
        raise AppError("This chat run's tokenizer has no chat template: it cannot be prompted as a chat model.")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return dict(tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}],
                                              add_generation_prompt=True, return_dict=True, return_tensors="pt"))


def generate_text(model, tokenizer, prompt: str, *, chat: bool, decoding: Decoding | None = None,
                  system_prompt: str | None = None) -> str:
    """`model`'s continuation of `prompt` ([`prompt_inputs`]) under `decoding`, without the prompt or special
    tokens. The global torch RNG is seeded with `decoding.seed` for this call only (restored afterwards)."""
    import torch

    decoding = decoding or Decoding()
    inputs = prompt_inputs(tokenizer, prompt, chat=chat, system_prompt=system_prompt)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = dict(max_new_tokens=decoding.max_new_tokens, pad_token_id=pad, do_sample=decoding.temperature > 0)
    if settings["do_sample"]:
        settings.update(temperature=decoding.temperature, top_p=decoding.top_p, top_k=0)
    else:
        settings.update(temperature=None, top_p=None, top_k=None)
    with _GENERATING, torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(decoding.seed)
        output = model.generate(**inputs, **settings)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def non_private_run(results_dir, run: RunRecord) -> RunRecord | None:
    """The non-private run to show beside `run`: one of the same task with a model (from the same folder first:
    the study's, or the Train tab's), `None` if there is none or `run` is it."""
    task = run.task.replace("_", "-")
    candidates = [r for r in list_runs(results_dir) if r.mechanism == NON_PRIVATE and r.model_path is not None
                  and r.task.replace("_", "-") == task and r.name != run.name]
    candidates.sort(key=lambda r: r.from_app != run.from_app)
    return candidates[0] if candidates else None


def _metric_text(run: RunRecord, value) -> str:
    better = " (lower is better)" if lower_is_better(run.metric_name) else ""
    return f"test {run.metric_name} {format_number(value, '.3f')}{better}"


@dataclasses.dataclass
class ColumnSpec:
    """One column of a language-model comparison, before it generates: its heading, the model's folder (or Hub
    id), what to call it in an error, and an adapter's base model."""

    heading: str
    model: object
    what: str = "model"
    base: str | None = None

    def load(self):
        return _language_model(self.model, self.what, self.base)


def column_specs(results_dir, run: RunRecord) -> list[ColumnSpec]:
    """The columns of `run`'s comparison: the public-only baseline (the untouched base model, headed "no private
    data" and `run`'s `baseline_result`, measured on `run`'s test rows), `run` (its guarantee and `eval_result`),
    and the non-private run ([`non_private_run`]) when there is one."""
    config = run.result.get("config") or {}
    base = config.get("model_name_or_path") or run.result.get("base_model")
    base_name = Path(str(base)).name if base else "?"
    specs = [ColumnSpec(f"#### Public-only baseline\nthe untouched `{base_name}` · no private data · "
                        f"{_metric_text(run, run.result.get('baseline_result'))}", base, "base model")]
    for other in (run, non_private_run(results_dir, run)):
        if other is None:
            continue
        heading = (f"#### {mechanism_label(other.mechanism)}: `{other.name}`\n{other.guarantee()} · "
                   f"{_metric_text(other, other.eval_result)}")
        if other.from_app != run.from_app:  # a study run beside a Train-tab run: other test rows
            heading += " (on its own test rows)"
        other_base = (other.result.get("config") or {}).get("model_name_or_path")
        specs.append(ColumnSpec(heading, other.model_path, "model", other_base))
    return specs


def _prompting(run: RunRecord) -> dict:
    """Every column is prompted as the run was trained: a chat run's system prompt, if it had one, comes first."""
    config = run.result.get("config") or {}
    return dict(chat=run.is_chat, system_prompt=config.get("system_prompt") if run.is_chat else None)


def generate_column(spec: ColumnSpec, prompt: str, decoding: Decoding, **prompting) -> dict:
    """One column: its heading and text, or the heading and the one-line reason it has no text. The text of a model,
    prompt and decoding is generated once and kept."""
    try:
        model, tokenizer = spec.load()
        key = (_model_key(spec.model), prompt, tuple(sorted(prompting.items())), decoding.key())
        text = _TEXTS.get(key)
        if text is None:
            text = generate_text(model, tokenizer, prompt, decoding=decoding, **prompting)
            _TEXTS[key] = text
            while len(_TEXTS) > _TEXTS_SIZE:
                _TEXTS.popitem(last=False)
        return {"heading": spec.heading, "text": text or "(nothing: the model ended its reply at once)",
                "status": "done"}
    except Exception as error:
        return {"heading": spec.heading + "\n\n" + error_md(error), "text": "", "status": "error"}


def column_ready(spec: ColumnSpec, prompt: str, decoding: Decoding, **prompting) -> bool:
    """Whether the column's text is already known (no model to load, nothing to generate)."""
    try:
        key = (_model_key(spec.model), prompt, tuple(sorted(prompting.items())), decoding.key())
    except OSError:
        return False
    return key in _TEXTS


def language_model_columns(results_dir, run: RunRecord, prompt: str, decoding: Decoding | None = None) -> list[dict]:
    """The generations of the public-only baseline, `run` and (when there is one) the non-private run.

    Returns:
        `list[dict]`: two or three columns ([`column_specs`]), each `{"heading": markdown, "text": generation,
        "status": "done" or "error"}`. A column that cannot generate has `text` `""` and the one-line reason in its
        heading.
    """
    decoding = decoding or Decoding()
    prompting = _prompting(run)
    return [generate_column(spec, prompt, decoding, **prompting) for spec in column_specs(results_dir, run)]


def pending_column(spec: ColumnSpec, loaded: bool) -> dict:
    """A column still waiting for its text, with what it waits for in its heading."""
    what = "generating…" if loaded else "loading the model, then generating…"
    return {"heading": spec.heading + f"\n\n⏳ *{what}*", "text": "", "status": "pending"}


def preload(results_dir, run_name: str | None, *, background: bool = True) -> threading.Thread | None:
    """Load the models of `run_name`'s comparison (baseline, run, non-private run) into the cache, in a background
    thread unless `background` is false, so that the first click only generates. Errors are left for the click to
    report. Returns the thread (`None` when there is nothing to load)."""
    try:
        run = find_run(results_dir, run_name)
        if not run.is_language_model or run.model_path is None:
            return None
        specs = column_specs(results_dir, run)
    except Exception:
        return None

    def work():
        for spec in specs:
            try:
                spec.load()
            except Exception:  # the click says why, in the column
                pass

    if not background:
        work()
        return None
    thread = threading.Thread(target=work, name="hf-dp-app-preload", daemon=True)
    thread.start()
    return thread


def compare_layout(results_dir, run_name: str | None) -> dict:
    """What the Compare tab shows for `run_name` before any click: `language_model`, the column `headings` (three,
    `""` for a missing non-private column), `text_label` (the text box's label, [`TEXT_LABELS`]) and `error` (one
    line, or `""`). A classifier's headings and words for a classifier, the language-model columns' for a language
    model (a chat run's prompt is a user message): never the other kind's placeholders."""
    try:
        run = find_run(results_dir, run_name)
    except Exception as error:
        return {"language_model": False, "headings": ["", "", ""], "error": error_md(error),
                "text_label": TEXT_LABELS["classifier"]}
    if not run.is_language_model:
        return {"language_model": False, "headings": list(CLASSIFIER_HEADINGS) + [""], "error": "",
                "text_label": TEXT_LABELS["classifier"]}
    shown = {"language_model": True, "headings": ["", "", ""], "error": "",
             "text_label": TEXT_LABELS["chat" if run.is_chat else "generative"]}
    try:
        headings = [spec.heading for spec in column_specs(results_dir, run)] if run.model_path is not None else []
    except Exception as error:
        return dict(shown, error=error_md(error))
    return dict(shown, headings=(headings + ["", "", ""])[:3])


def compare_steps(results_dir, run_name: str | None, text: str | None, decoding: Decoding | None = None):
    """[`compare_view`] column by column: yields the view first with every column pending, then again each time
    a column has its text (language models; a classifier's view is yielded once, complete). The last view yielded
    is [`compare_view`]'s."""
    out = {"baseline": None, "dp": None, "columns": [], "language_model": False, "decoding": "", "header": "",
           "error": ""}
    try:
        run = find_run(results_dir, run_name)
        if not text or not text.strip():
            raise AppError("Type or pick a text to compare.")
        text = text.strip()
        out["header"] = compare_header(run)
        if not run.is_language_model:
            out["baseline"], out["dp"] = _classify(run, text)
            yield out
            return
        if run.model_path is None:
            raise AppError(f"{run.name} is the public-only baseline (no fine-tuned model): pick a fine-tuned run.")
        decoding = decoding or Decoding()
        prompting = _prompting(run)
        specs = column_specs(results_dir, run)
        out["language_model"] = True
        out["decoding"] = decoding.describe(run.is_chat, prompting["system_prompt"])
        out["columns"] = [pending_column(spec, _loaded(spec)) for spec in specs]
        if not all(column_ready(spec, text, decoding, **prompting) for spec in specs):
            yield dict(out, columns=list(out["columns"]))
        for i, spec in enumerate(specs):
            out["columns"][i] = generate_column(spec, text, decoding, **prompting)
            if i + 1 < len(specs):
                out["columns"][i + 1] = pending_column(specs[i + 1], _loaded(specs[i + 1]))
                yield dict(out, columns=list(out["columns"]))
    except Exception as error:
        out.update(error=error_md(error), columns=[], baseline=None, dp=None)
    yield out


def _loaded(spec: ColumnSpec) -> bool:
    try:
        return _model_key(spec.model) in _MODELS
    except OSError:
        return False


def compare_view(results_dir, run_name: str | None, text: str | None, decoding: Decoding | None = None) -> dict:
    """The Compare tab for one run and one text.

    Returns:
        `dict` with `baseline` and `dp` (label -> probability, classifiers), `columns` (language models: the
        baseline's, the run's and the non-private run's generations, [`language_model_columns`]),
        `language_model`, `decoding` (the decoding in words, language models), `header` (markdown) and `error`
        (one line, or `""`).
    """
    out = None
    for out in compare_steps(results_dir, run_name, text, decoding):
        pass
    return out


def compare_header(run: RunRecord) -> str:
    """The line above the comparison: the run, its mechanism and guarantee, its `eval_result` and the baseline's."""
    result = run.result
    return (f"**{run.name}**: {mechanism_label(run.mechanism)}, {run.guarantee()}; test {run.metric_name} "
            f"{format_number(result.get('eval_result'), '.3f')} vs public-only baseline "
            f"{format_number(result.get('baseline_result'), '.3f')}"
            + (" (lower is better)." if lower_is_better(run.metric_name) else "."))
