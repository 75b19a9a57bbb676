"""The prefixes training wrappers put on every parameter name (DDP's ``module.``,
``torch.compile``'s ``_orig_mod.``), and a state dict's names without them: every reader of a
foreign file, with torch or without, names a parameter alike.

>>> strip({"module._orig_mod.w": 1, "module._orig_mod.b": 2})
({'w': 1, 'b': 2}, 'module._orig_mod.')
"""
from __future__ import annotations

from typing import Any

PREFIXES = ("module.", "_orig_mod.")       # DDP's and torch.compile's wrappers


def strip(names: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``names`` without the wrapper prefixes every key carries; the prefix removed."""
    prefix = ""
    while names:
        found = next((p for p in PREFIXES if all(isinstance(k, str) and k.startswith(p) for k in names)), None)
        if found is None:
            break
        prefix += found
        names = {k[len(found):]: v for k, v in names.items()}
    return names, prefix
