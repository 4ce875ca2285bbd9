"""Which modules of a model the clipper hooks, found and checked before any step.

DP-SGD's guarantee holds only if *every* trainable parameter's gradient is clipped. So attaching
walks the model once, gives each module with trainable parameters its clipping rule
([`~hf_dp.clipping.registry`]; the rules are the modules of [`~hf_dp.clipping.rules`], found there
without an import line naming them), and refuses the model, naming every offending module, when a
trainable parameter has no rule, is shared by layers whose rules cannot give the joint norm, or
sits in a layer the rule cannot handle. Failing here, at construction, is cheaper and clearer than
failing (or silently leaking) in the middle of training.

It also records, for each layer, the blocks transformers may checkpoint around it (their layers
take their inputs from the backward pass's recomputation, see [`~hf_dp.clipping.capture`]), and
refuses reentrant checkpointing, which runs the forward pass without gradients and cannot stop the
backward pass at a layer's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from torch import nn

from . import rules
from .registry import Rule, UnsupportedLayerError, find_rule, overrides_forward

try:  # transformers' blocks that `gradient_checkpointing_enable()` checkpoints
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover - older transformers
    GradientCheckpointingLayer = None


@dataclass
class HookedLayer:
    """A hooked module: where it is, its rule, and its trainable direct parameters."""

    path: str
    module: nn.Module
    rule: Rule
    params: Dict[str, nn.Parameter]  # trainable direct parameters, by name
    functional: bool = False  # captured at its rule's torch function call (a subclass with its own forward)
    checkpoint_blocks: Tuple[nn.Module, ...] = ()  # enclosing blocks transformers may checkpoint


@dataclass
class AttachedLayers:
    """Every hooked layer of a model, and the trainable parameters they cover.

    Args:
        by_module (`dict`): each hooked module's [`HookedLayer`].
        also_on_ruleless (`list[str]`): paths of parameters also registered on a module without a rule
            (BERT's LM head registers the decoder's bias on itself); named when the coverage check fails.
    """

    by_module: Dict[nn.Module, HookedLayer]
    also_on_ruleless: List[str]

    @property
    def params(self) -> List[nn.Parameter]:
        """Every trainable parameter of the hooked layers, once each (a shared one is listed once)."""
        unique: Dict[int, nn.Parameter] = {}
        for layer in self.by_module.values():
            for param in layer.params.values():
                unique.setdefault(id(param), param)
        return list(unique.values())

    def param_paths(self) -> Dict[int, str]:
        """`id(param)` -> `"<layer path>.<name>"` (for a shared parameter: its last layer)."""
        return {id(p): f"{layer.path}.{name}" for layer in self.by_module.values() for name, p in layer.params.items()}

    def rules(self) -> Dict[str, str]:
        """Hooked module paths and the rule clipping each."""
        return {layer.path: layer.rule.name for layer in self.by_module.values()}


def find_layers(model: nn.Module) -> AttachedLayers:
    """The layers to hook, each with its rule; raises [`UnsupportedLayerError`] naming every module that
    leaves a trainable parameter unclipped."""
    rules.load_rules()  # every rule module of `hf_dp.clipping.rules`, a new one included
    layers: Dict[nn.Module, HookedLayer] = {}
    problems: List[str] = []
    users: Dict[int, List[Tuple[str, str, str]]] = {}  # id(param) -> [(path, param name, kind)]
    ruleless: List[Tuple[str, str, Dict[str, nn.Parameter]]] = []  # (path, where, trainable)
    for path, module in model.named_modules():
        trainable = {name: p for name, p in module.named_parameters(recurse=False) if p.requires_grad}
        if not trainable:
            continue
        where = f"{path or '<root>'} ({type(module).__module__}.{type(module).__qualname__})"
        rule = find_rule(module)
        if rule is None:
            ruleless.append((path, where, trainable))
            continue
        uncovered = sorted(set(trainable) - set(rule.params))
        if uncovered:
            problems.append(f"{where}: trainable {uncovered} not covered by the '{rule.name}' rule")
            continue
        reason = rule.validate(module) if rule.validate is not None else None
        if reason is not None:
            problems.append(f"{where}: the '{rule.name}' rule cannot clip this layer: {reason}")
            continue
        functional = rule.function is not None and overrides_forward(module)
        layers[module] = HookedLayer(path=path, module=module, rule=rule, params=trainable, functional=functional)
        for name, param in trainable.items():
            users.setdefault(id(param), []).append((path, name, rule.params[name]))
    # A parameter registered on a rule-less module too (BERT's LM head registers the
    # decoder's bias on itself) is covered by the layer with the rule; whether the
    # rule-less module also uses it is checked against autograd on the first backward.
    also_on_ruleless: List[str] = []
    for path, where, trainable in ruleless:
        missing = sorted(name for name, param in trainable.items() if id(param) not in users)
        if missing:
            problems.append(f"{where}: trainable {missing} and no clipping rule for this layer type")
        also_on_ruleless += [f"{path}.{name}" for name, p in trainable.items() if id(p) in users]
    for shared in users.values():
        if len(shared) > 1 and len({kind for _, _, kind in shared}) > 1:
            where = ", ".join(f"{path}.{name}" for path, name, _ in shared)
            problems.append(
                f"parameter shared by {where}: its layers' rules cannot give the exact joint norm; "
                "freeze it (requires_grad_(False)) or untie it"
            )
    if problems:
        raise UnsupportedLayerError(
            "GhostClipper cannot clip every trainable parameter of this model:\n  - "
            + "\n  - ".join(problems)
            + "\nFreeze these parameters, or register a rule with hf_dp.clipping.register_rule."
        )
    if GradientCheckpointingLayer is not None:
        modules = dict(model.named_modules())
        for layer in layers.values():
            parts = layer.path.split(".")
            ancestors = (modules.get(".".join(parts[:end])) for end in range(len(parts)))
            layer.checkpoint_blocks = tuple(m for m in ancestors if isinstance(m, GradientCheckpointingLayer))
    return AttachedLayers(by_module=layers, also_on_ruleless=also_on_ruleless)


def check_gradient_checkpointing(model: nn.Module) -> None:
    """Refuse reentrant checkpointing: it runs the forward without gradients and cannot stop at edges."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)  # set by transformers
        if getattr(checkpoint, "keywords", {}).get("use_reentrant", False):
            raise ValueError(
                "GhostClipper supports non-reentrant gradient checkpointing only (the reentrant form runs the "
                "forward pass without gradients and cannot stop the backward pass at each layer's output); call "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                "(the default) or set gradient_checkpointing_kwargs={'use_reentrant': False} in the arguments"
            )
