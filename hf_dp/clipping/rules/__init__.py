"""The clipping rules, one module per layer family; every module of this package is found and imported here.

A rule module registers its rules with [`~hf_dp.clipping.register_rule`] when imported. Nothing names the modules:
[`load_rules`] lists this package's folder (`pkgutil`), so a new layer family is one new file here and no import
line elsewhere. [`~hf_dp.clipping.attach.find_layers`] calls it before it looks any rule up, so a module added to
the package's path after the first import is found at the next attach. A rule kept outside `hf_dp` registers
itself the same way, from a module its own code imports before the trainer is built.
"""
from __future__ import annotations

import importlib
import pkgutil

__all__ = ["load_rules"]


def load_rules() -> list[str]:
    """Import every module of this package not yet imported (each registers its rules); returns all their names.

    Cheap after the first call (a listing of the package's folder): modules already imported are not run again.
    """
    return [importlib.import_module(f"{__name__}.{module.name}").__name__ for module in pkgutil.iter_modules(__path__)]


load_rules()
