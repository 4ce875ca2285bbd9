"""Clipping rules, looked up by layer type.

A *rule* is a small pure function for one layer family. It takes the layer, the
activations it saw in the forward pass and the gradients of the loss with respect to
its output, and describes each trainable parameter's **per-example** gradient in a
factored form (see [`~hf_dp.clipping.terms`]). The engine groups examples into units,
computes per-unit squared norms from those factors, and forms the clipped sum.

Lookup walks the layer type's MRO, so subclasses inherit the rule of their parent
(peft's LoRA `lora_A`/`lora_B` and `modules_to_save` copies are plain `nn.Linear`).
Some families are matched by name instead of by type (every `*RMSNorm` class of
transformers, which each model defines anew). Nothing matching is a loud error:
[`UnsupportedLayerError`], raised before any step.

Example:

```python
>>> import torch
>>> from hf_dp.clipping.registry import find_rule
>>> find_rule(torch.nn.Linear(3, 2)).name
'linear'

```
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

from torch import nn

from .terms import GradTerm

RuleFn = Callable[..., Mapping[str, GradTerm]]
"""`rule(layer, activations, output_grads) -> {param_name: GradTerm}`."""


class UnsupportedLayerError(TypeError):
    """A trainable parameter lives in a layer that no clipping rule covers.

    Raised by [`~hf_dp.clipping.GhostClipper`] when it is attached, before any training
    step, naming every offending module path and type. Freeze the parameter
    (`requires_grad_(False)`), or register a rule for the layer type with
    [`register_rule`].
    """


@dataclass(frozen=True)
class Rule:
    """A registered clipping rule.

    Args:
        name (`str`): short name shown in errors and reports.
        fn (`Callable`): the pure rule function.
        params (`dict[str, str]`): the direct parameters of the layer the rule handles,
            each with the kind of gradient term the rule returns for it (`"outer"` for a
            [`~hf_dp.clipping.terms.OuterGrad`], `"example"` for an
            [`~hf_dp.clipping.terms.ExampleGrad`]). A trainable direct parameter not listed
            here is an error at attach time; a parameter shared by several layers is
            supported only when all of them describe it with terms of the same kind.
        capture_input (`bool`): whether the rule needs the layer's first positional
            input (activations or token ids).
        validate (`Callable`, *optional*): called with the layer at attach time; returns a
            reason string when this particular instance cannot be handled (e.g. an
            `nn.Embedding` with `max_norm`), else `None`.
        function (`Callable`, *optional*): the torch function (`F.embedding`, `F.linear`)
            whose call with the layer's `weight` the rule describes. A subclass of the
            registered type that overrides `forward` (Gemma's scaled token embedding,
            BART's and OPT's learned positions, which compute their own ids) is captured at
            that call instead of at the module's input and output.
    """

    name: str
    fn: RuleFn
    params: Mapping[str, str]
    capture_input: bool = True
    validate: Optional[Callable[[nn.Module], Optional[str]]] = None
    function: Optional[Callable] = None


_RULES_BY_TYPE: Dict[type, Rule] = {}
_RULES_BY_NAME: list = []  # (predicate on class, Rule), tried in registration order


def register_rule(
    *layer_types: type,
    name: str,
    params: Mapping[str, str],
    capture_input: bool = True,
    validate: Optional[Callable[[nn.Module], Optional[str]]] = None,
    class_name_predicate: Optional[Callable[[type], bool]] = None,
    function: Optional[Callable] = None,
):
    """Decorator registering a rule for layer types (and/or a class-name predicate).

    Args:
        *layer_types (`type`): layer classes the rule applies to (and, through the MRO
            walk, their subclasses).
        name (`str`): short rule name.
        params (`Mapping[str, str]`): direct parameter names the rule describes, with
            their term kind (`"outer"` or `"example"`).
        capture_input (`bool`, *optional*, defaults to `True`): capture the first input.
        validate (`Callable`, *optional*): per-instance check, see [`Rule`].
        class_name_predicate (`Callable[[type], bool]`, *optional*): also match classes
            for which this returns `True` (tried after exact type matches).
        function (`Callable`, *optional*): the torch function the rule describes, see [`Rule`].
    """

    def decorator(fn: RuleFn) -> RuleFn:
        rule = Rule(
            name=name, fn=fn, params=dict(params), capture_input=capture_input, validate=validate, function=function
        )
        for layer_type in layer_types:
            _RULES_BY_TYPE[layer_type] = rule
        if class_name_predicate is not None:
            _RULES_BY_NAME.append((class_name_predicate, rule))
        return fn

    return decorator


def find_rule(layer: nn.Module) -> Optional[Rule]:
    """The rule for `layer`: first registered type along its MRO, then name predicates."""
    return _lookup(layer)[0]


def overrides_forward(layer: nn.Module) -> bool:
    """Whether `layer`'s class overrides the `forward` of the type its rule is registered for.

    `False` for layers matched by name (their own class is what the rule describes).
    """
    owner = _lookup(layer)[1]
    return owner is not None and owner is not type(layer) and type(layer).forward is not owner.forward


def _lookup(layer: nn.Module) -> Tuple[Optional[Rule], Optional[type]]:
    """The rule, and the registered type it was found on (`None` for a match by name)."""
    mro = type(layer).__mro__
    for cls in mro:
        rule = _RULES_BY_TYPE.get(cls)
        if rule is not None:
            return rule, cls
    for cls in mro:
        if cls in (nn.Module, object):
            break
        for predicate, rule in _RULES_BY_NAME:
            if predicate(cls):
                return rule, None
    return None, None


def registered_rules() -> Dict[str, Rule]:
    """All registered rules by name (for reports and docs)."""
    rules = {rule.name: rule for rule in _RULES_BY_TYPE.values()}
    rules.update({rule.name: rule for _, rule in _RULES_BY_NAME})
    return rules
