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


def key_of(name: str, prefix: str, keys: set[str]) -> str:
    """A parameter name as the stripped state dict has it: without the prefix stripped from the
    keys, or without a wrapper's own prefixes (names from a DDP or compiled wrapper beside a
    state dict of the bare model); unchanged where neither gives a key."""
    if prefix and name.startswith(prefix) and name[len(prefix):] in keys:
        return name[len(prefix):]
    bare = name
    while bare not in keys and bare.startswith(PREFIXES):
        bare = bare[len(next(p for p in PREFIXES if bare.startswith(p))):]
    return bare if bare in keys else name
