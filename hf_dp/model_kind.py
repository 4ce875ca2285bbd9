"""What model a run trains: the model under its wrappers, and whether its labels are next-token targets."""

from __future__ import annotations

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["is_causal_lm", "underlying_model"]


def underlying_model(model):
    """The model under peft (`get_base_model`), DDP (`module`) and `torch.compile` (`_orig_mod`) wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    return model


_CAUSAL_LM_CLASSES = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model) -> bool:
    """Whether the model's labels are shifted next-token targets, read from transformers' causal-LM registry.

    The model (peft, DDP and `torch.compile` wrappers unwrapped) is a causal LM when it is an instance of the class
    `AutoModelForCausalLM` maps its config to, when its config's `auto_map` (remote code) names one of its classes
    for `AutoModelForCausalLM`, or when it subclasses one of transformers' causal-LM heads. Its own class name does
    not matter: `class Decoder(LlamaForCausalLM)` is one, `LlamaForSequenceClassification` is not.
    """
    base = underlying_model(model)
    classes = type(base).__mro__
    config = getattr(base, "config", None)
    if config is not None:
        try:
            head = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except (KeyError, ValueError, ImportError, AttributeError):  # a config transformers does not register
            head = None
        if isinstance(head, type) and isinstance(base, head):
            return True
        remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
        if isinstance(remote, (list, tuple)):
            remote = remote[0] if remote else None
        if isinstance(remote, str) and remote.rsplit(".", 1)[-1] in {cls.__name__ for cls in classes}:
            return True
    return any(cls.__module__.startswith("transformers.") and cls.__name__ in _CAUSAL_LM_CLASSES for cls in classes)
