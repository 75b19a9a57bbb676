"""Each benchmark's result document, as the schema takes it apart (``shape.Shape``).

The documents are what the scripts have always built; a shape only names their levels. The
stamps (when, what command, which machine and commit) come out of the document first, under
whichever key its script used (``date`` or ``when``; ``machine`` a dict or a sentence; a few
scripts put ``cpus`` or ``python`` at the top).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .shape import Shape

STAMPS = ("machine", "commit", "date", "command")


@dataclass(frozen=True)
class Spec:
    shape: Shape
    date_keys: tuple[str, ...] = ("date", "when")
    machine_keys: tuple[str, ...] = ()                    # top-level keys that describe the machine
    commit: Callable[[dict], str | None] | None = None    # the measured commit, where the document says it
    per_record: Callable[[dict, dict], dict] | None = None   # stamps of one record (a document joined from two runs)

    def stamps(self, doc: dict) -> tuple[dict[str, Any], dict]:
        """The document's stamps (None where it has none) and the document without them."""
        rest = dict(doc)
        date = next((rest.pop(k) for k in self.date_keys if k in rest), None)
        machine = rest.pop("machine", None)
        machine = {"description": machine} if isinstance(machine, str) else dict(machine or {})
        machine.update({k: rest.pop(k) for k in self.machine_keys if k in rest})
        commit = rest.pop("git_commit", None) or (self.commit(doc) if self.commit else None)
        return {"machine": machine or None, "commit": commit, "date": date, "command": rest.pop("command", None)}, rest


# ---------------------------------------------------------------- transforms, each with its inverse
def _keyed(list_key: str, by: str, into: str) -> tuple[Callable[[dict], dict], Callable[[dict], dict]]:
    """A list of dicts under ``list_key`` as a dict ``into`` keyed by each one's ``by`` (and back)."""
    def there(doc: dict) -> dict:
        out = {k: v for k, v in doc.items() if k != list_key}
        out[into] = {r[by]: r for r in doc.get(list_key, [])}
        return out

    def back(doc: dict) -> dict:
        out = {k: v for k, v in doc.items() if k != into}
        out[list_key] = list(doc.get(into, {}).values())
        return out
    return there, back


def _variants(doc: dict) -> dict:
    out = {k: v for k, v in doc.items() if k not in ("median_ms", "vs_copy_limit")}
    out["variants"] = {name: {"median_ms": ms, "vs_copy_limit": doc["vs_copy_limit"][name]}
                       for name, ms in doc["median_ms"].items()}
    return out


def _variants_back(doc: dict) -> dict:
    out = {k: v for k, v in doc.items() if k != "variants"}
    out["median_ms"] = {k: v["median_ms"] for k, v in doc["variants"].items()}
    out["vs_copy_limit"] = {k: v["vs_copy_limit"] for k, v in doc["variants"].items()}
    return out


def _forms(doc: dict) -> dict:
    out: dict = {"checkpoints": {}}
    for name, c in doc.items():
        forms: dict = {}
        for row in c["rows"]:
            forms.setdefault(row["form"], {})[row["level"]] = {k: v for k, v in row.items() if k not in ("form", "level")}
        out["checkpoints"][name] = {"bin_bytes": c["bytes"], "forms": forms}
    return out


def _forms_back(doc: dict) -> dict:
    return {name: {"bytes": c["bin_bytes"], "rows": [{"form": f, "level": lv, **row} for f, levels in c["forms"].items()
                                                     for lv, row in levels.items()]}
            for name, c in doc["checkpoints"].items()}


def _ops(doc: dict) -> dict:
    """Lightning's "save:ckptfmt" timings as operation, then contender."""
    out = {k: v for k, v in doc.items() if k != "results"}
    out["results"] = {}
    for size, r in doc["results"].items():
        times: dict = {}
        for key, stats in r["times"].items():
            op, _, who = key.partition(":")
            times.setdefault(op, {})[who] = stats
        out["results"][size] = {**r, "times": times}
    return out


def _ops_back(doc: dict) -> dict:
    out = {k: v for k, v in doc.items() if k != "results"}
    out["results"] = {size: {**r, "times": {f"{op}:{who}": s for op, whos in r["times"].items() for who, s in whos.items()}}
                      for size, r in doc["results"].items()}
    return out


def _rows(doc: dict) -> dict:
    """The tiers' stall contenders: a list per figure -> one sample per repetition."""
    out = {**doc, "sizes": {}}
    for size, r in doc["sizes"].items():
        r = dict(r)
        if "stall" in r:
            stall = dict(r["stall"])
            stall["contenders"] = {name: {"samples": [dict(zip(c, row)) for row in zip(*c.values())]}
                                   for name, c in stall["contenders"].items()}
            r["stall"] = stall
        out["sizes"][size] = r
    return out


def _rows_back(doc: dict) -> dict:
    out = {**doc, "sizes": {}}
    for size, r in doc["sizes"].items():
        r = dict(r)
        if "stall" in r:
            stall = dict(r["stall"])
            stall["contenders"] = {name: {k: [s[k] for s in c["samples"]] for k in c["samples"][0]}
                                   for name, c in stall["contenders"].items()}
            r["stall"] = stall
        out["sizes"][size] = r
    return out


def _store_runs(record: dict, doc: dict) -> dict:
    """store_bench's committed result joins two runs (save and stall; restore): each record gets
    the date, commit and command of the run that measured it."""
    parts, commands = doc.get("parts"), doc.get("command")
    if not parts or not isinstance(commands, list):
        return {}
    which = 1 if record["parameters"].get("part") == "restore" else 0
    run = list(parts.values())[which]
    return {"date": run["date"], "commit": run["git_commit"], "command": commands[which]}


_HISTORY = _keyed("results", "steps", "lengths")
_SIZES = "sizes", "{size}"

SPECS: dict[str, Spec] = {
    "peers": Spec(Shape((
        (*_SIZES, "{part}", "{contender}"),
        (*_SIZES, "{part=load}", "{cache}", "{contender}"),
        ("{part=compression_tiny_trained}", "{choice}"),
        ("{part=compression_andrea12m_20_steps}", "{choice}"),
        ("{part=train}", "{figure=steps_per_s}", "{model}"),
        ("{part=train}", "{figure=stall}", "{mode}"),
        ("{part=stall}", "{mode}"),
        ("{part=goals}", "{size}")), context=("config", "n_params", "bytes"))),
    "facts": Spec(Shape(((*_SIZES, "{measurement}"),), context=("bytes",)), machine_keys=("cpus",)),
    "writer-contract": Spec(Shape(((*_SIZES, "{contender}"),))),
    "scale": Spec(Shape(((*_SIZES, "{operation}"),), context=("n_params", "bytes", "model_and_adam_gb"))),
    "load-variants": Spec(Shape((("variants", "{variant}"),), context=("config", "bytes", "reps"),
                                transform=_variants, inverse=_variants_back)),
    "compress": Spec(Shape((("checkpoints", "{checkpoint}", "forms", "{form}", "{level}"),), context=("bin_bytes",),
                           transform=_forms, inverse=_forms_back)),
    "export": Spec(Shape(context=("config", "bytes", "reps"))),
    "sharded-save": Spec(Shape((("ranks", "{ranks}"),), context=("config",))),
    "mirror": Spec(Shape(context=("bytes", "reps"))),
    "mirror-stall": Spec(Shape((("results", "{run}"),))),
    "store": Spec(Shape((
        (*_SIZES, "{part=save}", "{contender}"),
        (*_SIZES, "{part=restore}", "{contender}"),
        (*_SIZES, "{part=stall}", "{mode}")), context=("config", "n_params", "bin_bytes")), per_record=_store_runs),
    "history-scale": Spec(Shape((("lengths", "{steps}", "measured", "{tree}", "{operation}"),),
                                context=("reps", "generations", "every", "history_lines", "history_bytes"),
                                transform=_HISTORY[0], inverse=_HISTORY[1]),
                          machine_keys=("python",), commit=lambda doc: doc.get("revisions", {}).get(".")),
    "roots-scan": Spec(Shape((("seconds", "{contender}"),), context=("steps", "bytes", "reps"))),
    "digests": Spec(Shape((("contenders", "{contender}", "{clock}"),), context=("config", "reps", "block", "warmup"))),
    "tiers": Spec(Shape((
        (*_SIZES, "{part=stall}", "contenders", "{contender}"),
        (*_SIZES, "{part=restarts}", "{measurement}"),
        (*_SIZES, "{part=peer}", "{launch}")), context=("params", "bytes", "torch_threads"), lists=True,
        transform=_rows, inverse=_rows_back),
        commit=lambda doc: doc.get("tree", {}).get("checkout_head")),
    "lightning-io": Spec(Shape((("results", "{size}", "times", "{operation}", "{contender}"),), context=("reps",),
                               transform=_ops, inverse=_ops_back)),
    "cuda-manager": Spec(Shape((("variants", "{variant}"),), context=("device", "steps")), machine_keys=("gpu", "torch")),
    "gpu-check": Spec(Shape((("stages", "{stage}"),), context=("mode",)), date_keys=("started",)),
    "gpu-first-runs": Spec(Shape((("checks", "{check}"),)),       # checks by hand: each its own command
                           per_record=lambda rec, doc: {"command": (rec["summary"] or {}).get("command")}),
}
