"""The CLI contract, for every command on every hostile input.

One table: each row runs one of the 16 commands against one input of a corpus of hostile
inputs (missing paths, directories for files, empty and 7-byte files, impossible headers,
torn files, text renamed .bin, broken manifests, foreign files with partial metadata,
non-archives, read-only, missing and existing destinations, spaces and non-ASCII names,
symlinks) and asserts, with and without ``--json``:

* no traceback; the exit code of the contract (0 ok, 1 a defect or difference found,
  2 could not run);
* a failure says so in one line on stderr that names the path and the problem (or, for a check
  that ran and found a defect, in its report);
* with ``--json``, stdout is one strict JSON document (no NaN/Infinity), with an ``error``
  object when the command failed;
* after a failure nothing is left at the destination and nothing that existed before changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import io

import numpy as np
import pytest
import zstandard

import ckptfmt
from ckptfmt import seal, shards, tensorfile
from ckptfmt.cli import main
from conftest import arrays, cli, make, small_tmpfs

LAYOUT = [{"name": "a", "shape": [6], "offset": 0}, {"name": "b", "shape": [2, 2], "offset": 6}]
TEXT = ("Hello, this is not a checkpoint: a README somebody renamed to .bin by mistake.\n"
        "Its first bytes read as a header that promises 23 GB!!!\n")
NO_JSON = {"train"}          # train streams a log; every other command takes --json


# ---------------------------------------------------------------- the corpus
def _save(directory, step, n=10, seed=0, **kwargs):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:06d}.bin")
    ckptfmt.save(path, step, *arrays(n, seed), **kwargs)
    return path


def _history(directory, steps):
    with open(os.path.join(directory, ".loss.json"), "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "source": "code"}) + "\n")


def _manifest_variant(root, name, edit, sealed=True):
    """A generation whose manifest ``edit`` changed: resealed (what a writer that seals what it
    writes wrong would leave: the schema is what fails) unless ``sealed`` is False (an edit after
    the commit: the seal is what fails)."""
    d = os.path.join(root, name)
    _save(d, 1, manifest={"layout": LAYOUT, "config": {"lr": 0.1}})
    mpath = os.path.join(d, "step_000001.json")
    with open(mpath) as f:
        doc = json.load(f)
    text = edit(doc)
    with open(mpath, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(seal.apply(doc) if sealed else doc))


def _safetensors(path, meta, regions=None, code="F32"):
    regions = regions if regions is not None else {r: a for r, a in zip(("weights", "m", "v"), arrays(10))}
    tensors = [(name, code, [arr.size], arr.astype({"F32": "<f4", "F16": "<f2"}[code]))
               for name, arr in regions.items()]
    tensorfile.write(path, tensors, meta)


def _foreign(root):
    d = os.path.join(root, "foreign")
    os.makedirs(d)
    good = {"format": "ckptfmt", "step": "1", "n_params": "10", "blake3": ""}
    _safetensors(f"{d}/nostep.safetensors", {k: v for k, v in good.items() if k != "step"})
    _safetensors(f"{d}/badstep.safetensors", {**good, "step": "x"})
    _safetensors(f"{d}/hugestep.safetensors", {**good, "step": str(2**40)})
    _safetensors(f"{d}/badlayout.safetensors", {**good, "layout": "{not json"})
    _safetensors(f"{d}/wronglayout.safetensors", {**good, "layout": json.dumps(LAYOUT[:1])})
    _safetensors(f"{d}/typelayout.safetensors", {**good, "layout": json.dumps({"a": 1})})
    w, m, v = arrays(10)
    _safetensors(f"{d}/shortm.safetensors", good, {"weights": w, "m": m[:7], "v": v})
    _safetensors(f"{d}/f16.safetensors", good, code="F16")
    _safetensors(f"{d}/nometa.safetensors", {})
    with open(f"{d}/notsafetensors.safetensors", "w") as f:
        f.write(TEXT)
    meta = {"format": "ckptfmt", "n_params": 10}
    np.savez(f"{d}/nostep.npz", weights=w, m=m, v=v, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    np.savez(f"{d}/badmeta.npz", weights=w, m=m, v=v, meta=np.frombuffer(b"{oops", np.uint8))
    np.savez(f"{d}/nometa.npz", weights=w, m=m, v=v)
    np.savez(f"{d}/listmeta.npz", weights=w, m=m, v=v, meta=np.frombuffer(b"[1, 2]", np.uint8))
    np.savez(f"{d}/intweights.npz", weights=np.arange(10), m=m, v=v,
             meta=np.frombuffer(json.dumps({**meta, "step": 1}).encode(), np.uint8))
    import torch
    torch.save({"format": "ckptfmt", "weights": torch.from_numpy(w.copy())}, f"{d}/nostep.pt")
    torch.save({"format": "ckptfmt", "step": "x", "weights": torch.from_numpy(w.copy()),
                "m": torch.from_numpy(m.copy()), "v": torch.from_numpy(v.copy())}, f"{d}/badstep.pt")
    torch.save([1, 2, 3], f"{d}/list.pt")
    with open(f"{d}/text.pt", "w") as f:
        f.write(TEXT)


def _archives(root):
    d = os.path.join(root, "archives")
    os.makedirs(d)
    with open(f"{d}/text.tar.zst", "w") as f:
        f.write(TEXT)
    with open(f"{d}/plain.tar.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(TEXT.encode()))
    for name, member in (("dotdot.tar.zst", "../evil.txt"), ("nomanifest.tar.zst", "hello.txt")):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(member)
            info.size = len(TEXT)
            tar.addfile(info, io.BytesIO(TEXT.encode()))
        with open(f"{d}/{name}", "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(buf.getvalue()))


def _files(root):
    d = os.path.join(root, "files")
    os.makedirs(d)
    good = open(_save(os.path.join(root, "good"), 1, manifest={"layout": LAYOUT}), "rb").read()
    for name, data in {"empty.bin": b"", "seven.bin": b"\1\0\0\0\2\0\0", "text.bin": TEXT.encode(),
                       "huge_n.bin": struct.pack("<ii", 1, 2**31 - 1) + b"\0" * 12,
                       "neg_n.bin": struct.pack("<ii", 1, -5), "neg_step.bin": struct.pack("<ii", -1, 0),
                       "trailing.bin": good + b"\0\0\0\0", "truncated.bin": good[:-8]}.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def _hostile_histories(root):
    """Runs whose loss history holds what no writer writes: a line nested too deeply to parse,
    a step record without a loss, a NaN literal, a loss that is an object; a history that is a directory; a symlink loop
    named like a generation."""
    for name, middle in (("hist_deep", '{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                         ("hist_noloss", '{"step": 2}'), ("hist_nanlit", '{"step": 2, "loss": NaN}'),
                         ("hist_badloss", '{"step": 2, "loss": {"x": 1}}')):
        d = os.path.join(root, name)
        for step in (1, 3):
            _save(d, step, seed=step, manifest={"layout": LAYOUT})
        with open(os.path.join(d, ".loss.json"), "w") as f:
            f.write('{"step": 1, "loss": 5.0}\n' + middle + '\n{"step": 3, "loss": 4.0}\n')
    _save(os.path.join(root, "hist_dir"), 1, manifest={"layout": LAYOUT})
    os.makedirs(os.path.join(root, "hist_dir", ".loss.json"))
    _save(os.path.join(root, "loop_run"), 1, manifest={"layout": LAYOUT})
    os.symlink("step_000002.bin", os.path.join(root, "loop_run", "step_000002.bin"))
    _save(os.path.join(root, "bad_pins"), 1, manifest={"layout": LAYOUT})
    with open(os.path.join(root, "bad_pins", ".pins.json"), "w") as f:
        f.write('{"pins": [1]}')                       # valid JSON, not a list of steps


def _sharded_run(root):
    """sharded_run: generations 1 and 2 of ``run`` (same values), each split into two shards
    with a companion file, and the same history: what a two-rank run leaves."""
    src = os.path.join(root, "sharded_src")
    for step in (1, 2):
        shards.split(_save(src, step, seed=step, manifest={"layout": LAYOUT},
                           extra_tensors={"bn.running_mean": np.full(3, step, "<f4")}),
                     os.path.join(root, "sharded_run"), 2)
    shutil.rmtree(src)
    _history(os.path.join(root, "sharded_run"), range(1, 3))
    shutil.copytree(os.path.join(root, "sharded_run"), os.path.join(root, "sharded_damaged"))
    with open(os.path.join(root, "sharded_damaged", "step_000002.shards", "00001-of-00002.bin"), "r+b") as f:
        f.seek(12)
        byte = f.read(1)
        f.seek(12)
        f.write(bytes([byte[0] ^ 1]))     # one bit of a weight: only the shard's blake3 can see it


def build_corpus(root):
    """Every hostile input, in one directory tree (copied afresh for each case)."""
    _files(root)
    _save(os.path.join(root, "good2"), 1, seed=1, manifest={"layout": LAYOUT})
    for step in (1, 2):
        _save(os.path.join(root, "run"), step, seed=step, manifest={"layout": LAYOUT})
    _history(os.path.join(root, "run"), range(1, 3))
    _sharded_run(root)
    os.makedirs(os.path.join(root, "empty_run"))
    os.makedirs(os.path.join(root, "hist_only"))
    _history(os.path.join(root, "hist_only"), range(1, 4))
    damaged = os.path.join(root, "damaged_run")
    with open(_save(damaged, 1), "r+b") as f:
        f.truncate(50)
    _manifest_variant(root, "mf_invalid", lambda d: "{broken")
    _manifest_variant(root, "mf_types", lambda d: d.update(size="120", step=[1]))
    _manifest_variant(root, "mf_other", lambda d: d.update(file="step_000002.bin"))
    _manifest_variant(root, "mf_dotdot", lambda d: d.update(file="../step_000001.bin"))
    _manifest_variant(root, "mf_digest", lambda d: d.update(blake3="0" * 64))
    _manifest_variant(root, "mf_version", lambda d: d.update(format_version=99))
    _manifest_variant(root, "mf_layout", lambda d: d.update(layout=[{"name": "a", "shape": [3], "offset": 0}]))
    _manifest_variant(root, "mf_edited", lambda d: d["config"].update(lr=0.2), sealed=False)
    _manifest_variant(root, "mf_version_flipped", lambda d: d.update(format_version=3), sealed=False)
    _manifest_variant(root, "mf_dupkey", lambda d: json.dumps(d)[:-1] + ', "step": 2}')   # which step?
    _manifest_variant(root, "mf_deep", lambda d: json.dumps(d)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for field, value in (("rng", "x"), ("config", []), ("state", 7), ("buffers", [1])):   # not objects
        _manifest_variant(root, f"mf_{field}", lambda d, kv=(field, value): d.update([kv]))
    with open(os.path.join(root, "mf_config", ".state.json"), "w") as f:
        json.dump({"arms": {"code": {"pulls": 1}}}, f)          # the zombie-arm check reads config
    _hostile_histories(root)
    _foreign(root)
    _archives(root)
    _save(os.path.join(root, "spaced ü run"), 1, manifest={"layout": LAYOUT})
    _history(os.path.join(root, "spaced ü run"), [1])
    links = os.path.join(root, "links")
    os.makedirs(links)
    os.symlink("../good/step_000001.bin", os.path.join(links, "link.bin"))
    os.symlink("../nowhere.bin", os.path.join(links, "dangling.bin"))
    os.symlink("../run", os.path.join(links, "run"))
    linked_run = os.path.join(root, "linked_gen_run")
    os.makedirs(linked_run)
    os.symlink("../good/step_000001.bin", os.path.join(linked_run, "step_000001.bin"))
    os.symlink("../good/step_000001.json", os.path.join(linked_run, "step_000001.json"))
    os.makedirs(os.path.join(root, "outdir"))
    os.makedirs(os.path.join(root, "existing_dir"))
    with open(os.path.join(root, "existing_dir", "keep.txt"), "w") as f:
        f.write("mine\n")
    for name in ("existing.png", "existing.npz", "existing.bin", "existing.tar.zst"):
        with open(os.path.join(root, name), "w") as f:
            f.write("a file the user already had\n")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "w"
    root.mkdir()
    build_corpus(str(root))
    return root


@pytest.fixture(scope="module")
def readonly(tmp_path_factory):
    """A run directory (one committed generation, a history) nobody may write into: mode 0555,
    and, where the permission bits do not bind (root), bind-mounted read-only onto itself."""
    path = tmp_path_factory.mktemp("ro") / "ro run"
    _save(str(path), 1, manifest={"layout": LAYOUT})
    _history(str(path), [1])
    path.chmod(0o555)
    mounted = False
    if _writable(path):
        mounted = all(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in (
            ["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,bind,ro", str(path)]))
    assert not _writable(path), f"{path} must refuse writes for this test (root needs mount)"
    yield str(path)
    if mounted:
        subprocess.run(["umount", str(path)], check=True)
    path.chmod(0o755)


def _writable(path) -> bool:
    try:
        with open(os.path.join(path, ".probe"), "w"):
            pass
    except OSError:
        return False
    os.unlink(os.path.join(path, ".probe"))
    return True


@pytest.fixture
def world(template, tmp_path):
    root = tmp_path / "w"
    shutil.copytree(template, root, symlinks=True)
    return root


# ---------------------------------------------------------------- the table
B = "step_000001.bin"
FILE_INPUTS = {   # name -> (path, exit code of inspect and validate, a word the message holds)
    "missing": ("nope/step_000001.bin", 2, "no such file"),
    "empty": ("files/empty.bin", 1, "not a ckptfmt checkpoint"),
    "seven_bytes": ("files/seven.bin", 1, "not a ckptfmt checkpoint"),
    "text_renamed_bin": ("files/text.bin", 1, "not a ckptfmt checkpoint"),
    "header_n_2^31-1": ("files/huge_n.bin", 1, "header promises"),
    "header_n_negative": ("files/neg_n.bin", 1, "negative n_params"),
    "header_step_negative": ("files/neg_step.bin", 1, "negative step"),
    "trailing_bytes": ("files/trailing.bin", 1, "trailing data"),
    "truncated": ("files/truncated.bin", 1, "truncated: expected"),
    "manifest_invalid_json": (f"mf_invalid/{B}", 1, "not valid JSON"),
    "manifest_wrong_types": (f"mf_types/{B}", 1, "expected int"),
    "manifest_other_file": (f"mf_other/{B}", 1, "step_000002.bin"),
    "manifest_dotdot": (f"mf_dotdot/{B}", 1, "bare name"),
    "manifest_wrong_digest": (f"mf_digest/{B}", 1, "mismatch"),
    "manifest_unknown_version": (f"mf_version/{B}", 2, "newer than this ckptfmt"),
    "manifest_bad_layout": (f"mf_layout/{B}", 1, "layout covers"),
    "manifest_edited_after_its_seal": (f"mf_edited/{B}", 1, "field 'config' does not match the manifest's seal"),
    "manifest_version_flipped": (f"mf_version_flipped/{B}", 1, "field 'format_version' does not match"),
    "manifest_duplicate_name": (f"mf_dupkey/{B}", 1, "duplicate name 'step'"),
    "manifest_nested_too_deeply": (f"mf_deep/{B}", 1, "nested too deeply"),
    "directory_without_generations": ("existing_dir", 1, "no generation"),
    "dangling_symlink": ("links/dangling.bin", 2, "no such file"),
}
OK_FILES = {"spaces_non_ascii": f"spaced ü run/{B}", "symlink": "links/link.bin"}


# inspect shows what it can read: a manifest problem is reported in its output (exit 0); diff
# compares bytes (a wrong digest does not change them); what convert does with a source whose
# digest is wrong is tested with the conversions' trust (tests/cli/test_convert_trust.py).
OVERRIDES = {("inspect", n): 0 for n in FILE_INPUTS if n.startswith("manifest_")}
OVERRIDES.update({("diff", "manifest_wrong_digest"): 0, ("convert", "manifest_wrong_digest"): None})


def _cases():
    """(id, argv with {w} for the corpus and {ro} for the read-only run, expected exit code(s),
    the text the message (or the report) holds, paths that must not exist afterwards)."""
    cases = []
    for name, (path, code, word) in FILE_INPUTS.items():
        cases.append((f"validate-{name}", ["validate", f"{{w}}/{path}"], code, word, []))
        if name == "directory_without_generations":
            continue
        for cmd, argv, gone in (("inspect", ["inspect", f"{{w}}/{path}"], []),
                                ("diff", ["diff", f"{{w}}/{path}", f"{{w}}/good/{B}"], []),
                                ("convert", ["convert", f"{{w}}/{path}", "{w}/outdir/x.npz"], ["{w}/outdir/x.npz"])):
            want = OVERRIDES.get((cmd, name), code)
            if want is not None:
                cases.append((f"{cmd}-{name}", argv, want, word if want or cmd == "inspect" else "", gone))
    for name, path in OK_FILES.items():
        for cmd in (["validate"], ["inspect"], ["diff", f"{{w}}/good/{B}"]):
            cases.append((f"{cmd[0]}-{name}", [*cmd, f"{{w}}/{path}"], 0, "", []))
        cases.append((f"convert-{name}", ["convert", f"{{w}}/{path}", "{w}/spaced ü run/x y.safetensors"], 0, "", []))
    cases += [
        ("diff-directory-for-file", ["diff", "{w}/existing_dir", f"{{w}}/good/{B}"], 2, "directory", []),
        ("diff-different", ["diff", f"{{w}}/good/{B}", f"{{w}}/good2/{B}"], 1, "", []),
        ("diff-zero-norm", ["diff", "{w}/zero_a.bin", "{w}/zero_b.bin"], 1, "", []),
        ("convert-directory-for-file", ["convert", "{w}/existing_dir", "{w}/out.npz"], 2, "directory", ["{w}/out.npz"]),
        ("convert-unknown-target", ["convert", f"{{w}}/good/{B}", "{w}/out.xyz"], 2, "unknown format", ["{w}/out.xyz"]),
        ("convert-unknown-source", ["convert", "{w}/existing.png", "{w}/out.npz"], 2, "unknown format", ["{w}/out.npz"]),
        ("convert-existing-destination", ["convert", f"{{w}}/good/{B}", "{w}/existing.npz"], 2, "exists", []),
        ("convert-missing-destination-dir", ["convert", f"{{w}}/good/{B}", "{w}/no/such/dir/x.npz"], 2,
         "no/such/dir", ["{w}/no"]),
        ("convert-readonly-destination", ["convert", f"{{w}}/good/{B}", "{ro}/x.npz"], 2, "{ro}", []),
        ("convert-weights-only-to-bin", ["convert", f"{{w}}/good/{B}", f"{{w}}/outdir/{B}", "--weights-only"],
         2, "weights", [f"{{w}}/outdir/{B}"]),
        ("convert-dtype-to-zst", ["convert", f"{{w}}/good/{B}", "{w}/x.zst", "--weights-only", "--dtype", "float16"],
         2, "zst", ["{w}/x.zst"]),
        ("convert-bfloat16-to-npz", ["convert", f"{{w}}/good/{B}", "{w}/x.npz", "--weights-only", "--dtype",
                                     "bfloat16"], 2, "bfloat16", ["{w}/x.npz"]),
        ("convert-dtype-without-weights-only", ["convert", f"{{w}}/good/{B}", "{w}/x.npz", "--dtype", "float16"],
         2, "--weights-only", ["{w}/x.npz"]),
        ("convert-missing-npz", ["convert", "{w}/nope.npz", f"{{w}}/outdir/{B}"], 2, "nope.npz", []),
        ("convert-missing-pt", ["convert", "{w}/nope.pt", f"{{w}}/outdir/{B}"], 2, "nope.pt", []),
        ("convert-missing-safetensors", ["convert", "{w}/nope.safetensors", f"{{w}}/outdir/{B}"], 2,
         "nope.safetensors", []),
    ]
    for name, code, word in (("nostep.safetensors", 1, "step"), ("badstep.safetensors", 1, "step"),
                             ("hugestep.safetensors", 1, "step"), ("badlayout.safetensors", 1, "layout"),
                             ("wronglayout.safetensors", 1, "layout"), ("typelayout.safetensors", 1, "layout"),
                             ("shortm.safetensors", 1, "m"), ("f16.safetensors", 1, "F16"),
                             ("notsafetensors.safetensors", 1, "safetensors"), ("nostep.npz", 1, "step"),
                             ("badmeta.npz", 1, "meta"), ("listmeta.npz", 2, "format=ckptfmt"),
                             ("intweights.npz", 1, "weights"), ("nostep.pt", 1, "step"),
                             ("badstep.pt", 1, "step"), ("list.pt", (1, 2), "dict"), ("text.pt", 1, "torch.load")):
        cases.append((f"convert-foreign-{name}", ["convert", f"{{w}}/foreign/{name}", f"{{w}}/outdir/{B}"],
                      code, word, [f"{{w}}/outdir/{B}", "{w}/outdir/step_000001.json"]))
        cases.append((f"convert-foreign-{name}-to-zst", ["convert", f"{{w}}/foreign/{name}", "{w}/x.zst"],
                      code, word, ["{w}/x.zst"]))
    for name in ("nometa.safetensors", "nometa.npz"):   # not ckptfmt's: importing them is deliverable 4
        cases.append((f"convert-foreign-{name}", ["convert", f"{{w}}/foreign/{name}", "{w}/x.npz"],
                      (0, 2), "", []))
    cases += _run_cases() + _archive_cases() + _mirror_cases()
    return cases


def _run_cases():
    cases = []
    runs = {"missing": ("{w}/nope", 2, "no such"), "file_for_dir": (f"{{w}}/good/{B}", 2, "not a run directory"),
            "symlink_run": ("{w}/links/run", 0, "")}
    for name, (path, code, word) in runs.items():
        cases += [(f"ls-{name}", ["ls", path], code, word, []),
                  (f"gc-{name}", ["gc", path, "--keep-last", "1", "--dry-run"], code, word, []),
                  (f"pivot-{name}", ["pivot", path], code if code else 0, word, []),
                  (f"fork-{name}", ["fork", path, "{w}/forked", "--step", "1"], code, word,
                   [] if code == 0 else ["{w}/forked"]),
                  (f"bisect-{name}", ["bisect", path, "{w}/run"], code if code else 0, word, []),
                  (f"export-{name}", ["export", path, "{w}/exported"], code, word,
                   [] if code == 0 else ["{w}/exported"]),
                  (f"plot-{name}", ["plot", path, "--out", "{w}/p.png"], code, word,
                   [] if code == 0 else ["{w}/p.png"]),
                  (f"inspect-run-{name}", ["inspect", path], code, word, [])]
        if name == "file_for_dir":   # inspect takes a file as well as a run
            cases[-1] = (f"inspect-run-{name}", ["inspect", path], 0, "", [])
    cases += [
        ("ls-empty-run", ["ls", "{w}/empty_run"], 1, "no generation", []),
        ("validate-empty-run", ["validate", "{w}/empty_run"], 1, "no generation", []),
        ("validate-history-only", ["validate", "{w}/hist_only"], 1, "before its first checkpoint", []),
        ("inspect-history-only", ["inspect", "{w}/hist_only"], 1, "before its first checkpoint", []),
        ("validate-damaged-run", ["validate", "{w}/damaged_run"], 1, "truncated", []),
        ("validate-linked-generation", ["validate", "{w}/linked_gen_run"], 1, "symlink", []),
        ("pin-missing-step", ["pin", "{w}/run", "7"], 1, "no committed generation at step 7", []),
        ("pin-missing-run", ["pin", "{w}/nope", "1"], 2, "nope", ["{w}/nope"]),
        ("pin-readonly-run", ["pin", "{ro}", "1"], 2, "{ro}", []),
        ("pin-ok", ["pin", "{w}/run", "1"], 0, "", []),
        ("pivot-empty-run", ["pivot", "{w}/empty_run"], 1, "no committed generation", []),
        ("fork-missing-step", ["fork", "{w}/run", "{w}/forked", "--step", "7"], 1, "step 7", ["{w}/forked"]),
        ("fork-existing-destination", ["fork", "{w}/run", "{w}/existing_dir", "--step", "1"], 2, "exists", []),
        ("fork-readonly-destination", ["fork", "{w}/run", "{ro}/child", "--step", "1"], 2, "{ro}", []),
        ("fork-damaged", ["fork", "{w}/mf_digest", "{w}/forked", "--step", "1"], 1, "blake3", ["{w}/forked"]),
        ("fork-manifest-edited", ["fork", "{w}/mf_edited", "{w}/forked", "--step", "1"], 1, "seal", ["{w}/forked"]),
        ("fork-spaces", ["fork", "{w}/spaced ü run", "{w}/fork ü", "--step", "1"], 0, "", []),
        ("gc-missing-keep-last", ["gc", "{w}/run"], 2, "--keep-last", []),
        ("gc-readonly", ["gc", "{ro}", "--keep-last", "1"], 2, "{ro}", []),
        ("bisect-different", ["bisect", "{w}/run", "{w}/good"], 1, "", []),
        ("plot-existing-out", ["plot", "{w}/run", "--out", "{w}/existing.png"], 2, "exists", []),
        ("plot-empty-run", ["plot", "{w}/empty_run", "--out", "{w}/p.png"], 2, "no loss history", ["{w}/p.png"]),
        ("plot-readonly-out", ["plot", "{w}/run", "--out", "{ro}/p.png"], 2, "{ro}", []),
        ("plot-missing-out-dir", ["plot", "{w}/run", "--out", "{w}/no/dir/p.png"], 2, "no/dir", ["{w}/no"]),
        ("plot-spaces", ["plot", "{w}/spaced ü run", "--out", "{w}/spaced ü run/p ü.png"], 0, "", []),
        ("export-existing-destination", ["export", "{w}/run", "{w}/existing_dir"], 2, "exists", []),
        ("export-readonly-destination", ["export", "{w}/run", "{ro}/e"], 2, "{ro}", []),
        ("export-empty-run", ["export", "{w}/empty_run", "{w}/exported"], 1, "nothing to export", ["{w}/exported"]),
        ("export-damaged-run", ["export", "{w}/damaged_run", "{w}/exported"], 1, "truncated", ["{w}/exported"]),
        ("export-archive-existing", ["export", "{w}/run", "{w}/existing.tar.zst", "--archive"], 2, "exists", []),
        ("export-steps-naming-none", ["export", "{w}/run", "{w}/exported", "--steps", ",,"], 2,
         "--steps takes comma-separated integers", ["{w}/exported"]),
        ("export-archive-missing-dir", ["export", "{w}/run", "{w}/no/dir/e.tar.zst", "--archive"], 2, "no/dir",
         ["{w}/no"]),
        ("train-file-for-run", ["train", "--run", f"{{w}}/good/{B}", "--steps", "0"], 2, "not a run directory", []),
        ("train-foreign-run", ["train", "--run", "{w}/run", "--steps", "3"], 1, "cannot resume", []),
        ("train-readonly-run", ["train", "--run", "{ro}/r", "--steps", "0"], 2, "{ro}", []),
        ("train-missing-parent-file", ["train", "--run", f"{{w}}/good/{B}/r", "--steps", "0"], 2, "not a directory", []),
        ("verify-resume-existing-output", ["verify-resume", "--output", "{w}/existing_dir"], 2, "exists", []),
        ("verify-resume-output-is-file", ["verify-resume", "--output", "{w}/existing.png"], 2, "exists", []),
    ]
    return cases + _hostile_run_cases() + _sharded_run_cases()


def _sharded_run_cases():
    """Every command that takes a run, on a run of sharded generations (with companions)."""
    run, gen = "{w}/sharded_run", "{w}/sharded_run/step_000002.json"
    return [
        ("ls-sharded", ["ls", run], 0, "committed", []),
        ("inspect-run-sharded", ["inspect", run], 0, "shards", []),
        ("validate-sharded", ["validate", run], 0, "verified", []),
        ("validate-sharded-b3sums", ["validate", run, "--b3sums", "{w}/outdir/sums"], 0, "sums", []),
        ("gc-sharded", ["gc", run, "--keep-last", "1"], 0, "", []),
        ("pin-sharded", ["pin", run, "1"], 0, "", []),
        ("pivot-sharded", ["pivot", run], 0, "", []),
        ("fork-sharded", ["fork", run, "{w}/forked", "--step", "1"], 0, "", []),
        ("bisect-sharded", ["bisect", run, run], 0, "", []),
        ("export-sharded", ["export", run, "{w}/exported", "--steps", "1,2"], 0, "", []),
        ("export-sharded-archive", ["export", run, "{w}/e.tar.zst", "--archive"], 0, "step_000002.json", []),
        ("export-sharded-weights-only", ["export", run, "{w}/exported", "--weights-only"], 0, "", []),
        ("plot-sharded", ["plot", run, "--out", "{w}/p.png"], 0, "", []),
        ("inspect-sharded-generation", ["inspect", gen], 0, "shards", []),
        ("diff-sharded-generation", ["diff", gen, "{w}/run/step_000002.bin"], 0, "", []),
        ("convert-sharded-generation", ["convert", gen, "{w}/outdir/x.safetensors"], 0, "", []),
        ("convert-sharded-generation-to-bin", ["convert", gen, "{w}/outdir/step_000002.bin"], 0, "", []),
        ("fork-sharded-shard-damaged", ["fork", "{w}/sharded_damaged", "{w}/forked", "--step", "2"], 1, "blake3",
         ["{w}/forked"]),
        ("export-sharded-shard-damaged", ["export", "{w}/sharded_damaged", "{w}/exported", "--steps", "2"], 1,
         "blake3", ["{w}/exported"]),
        ("validate-sharded-shard-damaged", ["validate", "{w}/sharded_damaged"], 1, "00001-of-00002.bin", []),
    ]


def _hostile_run_cases():
    """Histories no writer writes, a pins file that is not a list of steps, a symlink loop in a
    run, a fork that fails half-way, option values out of range."""
    good, good2 = f"{{w}}/good/{B}", f"{{w}}/good2/{B}"
    return [
        ("validate-history-nested-too-deeply", ["validate", "{w}/hist_deep"], 1, "line 2: corrupt record", []),
        ("plot-history-nested-too-deeply", ["plot", "{w}/hist_deep", "--out", "{w}/p.png"], 0, "", []),
        ("fork-history-nested-too-deeply", ["fork", "{w}/hist_deep", "{w}/forked", "--step", "3"], 0, "", []),
        ("bisect-history-nested-too-deeply", ["bisect", "{w}/hist_deep", "{w}/hist_noloss"], 1, "", []),
        ("plot-history-without-loss", ["plot", "{w}/hist_noloss", "--out", "{w}/p.png"], 0, "", []),   # a gap
        ("plot-history-loss-not-a-number", ["plot", "{w}/hist_badloss", "--out", "{w}/p.png"], 1,
         "step 2 has a loss that is not a number", ["{w}/p.png"]),
        ("fork-history-nan-literal", ["fork", "{w}/hist_nanlit", "{w}/forked", "--step", "3"], 0, "", []),
        ("fork-history-is-a-directory", ["fork", "{w}/hist_dir", "{w}/forked", "--step", "1"], 2, ".loss.json",
         ["{w}/forked"]),
        ("fork-fails-into-missing-parents", ["fork", "{w}/hist_dir", "{w}/new/deep/forked", "--step", "1"], 2,
         ".loss.json", ["{w}/new"]),
        ("pin-pins-not-a-list", ["pin", "{w}/bad_pins", "1"], 1, "expected a list of steps", []),
        ("gc-pins-not-a-list", ["gc", "{w}/bad_pins", "--keep-last", "1"], 1, "expected a list of steps", []),
        ("ls-pins-not-a-list", ["ls", "{w}/bad_pins"], 1, "expected a list of steps", []),
        ("train-manifest-rng-not-an-object", ["train", "--run", "{w}/mf_rng", "--steps", "3"], 1,
         "field 'rng': expected an object", []),
        ("validate-manifest-config-not-an-object", ["validate", "{w}/mf_config"], 0, "", []),
        ("export-manifest-state-not-an-object", ["export", "{w}/mf_state", "{w}/exported"], 0, "", []),
        ("convert-manifest-buffers-not-an-object", ["convert", f"{{w}}/mf_buffers/{B}", "{w}/x.pt", "--to", "torch"],
         2, "buffers field is not an object", ["{w}/x.pt"]),
        ("train-seed-negative", ["train", "--run", "{w}/newrun", "--steps", "3", "--seed", "-1"], 2, "--seed",
         ["{w}/newrun"]),
        ("train-set-sources-without-caps-sum", ["train", "--run", "{w}/newrun", "--steps", "3", "--set",
                                                'sources=["code"]'], 2, "caps to at least 1", ["{w}/newrun"]),
        ("validate-symlink-loop-in-run", ["validate", "{w}/loop_run"], 0, "skipped", []),
        ("validate-symlink-loop", ["validate", "{w}/loop_run/step_000002.bin"], 2, "symbolic links", []),
        ("diff-atol-nan", ["diff", good, good2, "--atol", "nan"], 2, "finite number >= 0", []),
        ("diff-rtol-negative", ["diff", good, good2, "--rtol", "-1"], 2, "finite number >= 0", []),
        ("train-set-lr-nan", ["train", "--run", "{w}/newrun", "--steps", "3", "--set", "lr=NaN"], 2, "lr must be",
         ["{w}/newrun"]),
        ("train-set-batch-float", ["train", "--run", "{w}/newrun", "--steps", "3", "--set", "batch=1.5"], 2,
         "batch must be an integer", ["{w}/newrun"]),
        ("train-steps-beyond-int32", ["train", "--run", "{w}/newrun", "--steps", str(2**31)], 2, "2147483647",
         ["{w}/newrun"]),
    ]


def _archive_cases():
    cases = []
    for name, word in (("text.tar.zst", "not an export archive"), ("plain.tar.zst", "not an export archive"),
                       ("dotdot.tar.zst", "unsafe"), ("nomanifest.tar.zst", "export.json")):
        cases.append((f"import-{name}", ["import", f"{{w}}/archives/{name}", "{w}/imported"], 1, word,
                      ["{w}/imported"]))
    cases += [
        ("import-missing-archive", ["import", "{w}/nope.tar.zst", "{w}/imported"], 2, "nope.tar.zst", ["{w}/imported"]),
        ("import-directory-archive", ["import", "{w}/existing_dir", "{w}/imported"], 2, "directory", ["{w}/imported"]),
        ("import-checkpoint-as-archive", ["import", f"{{w}}/good/{B}", "{w}/imported"], 1, "not an export archive",
         ["{w}/imported"]),
        ("import-existing-destination", ["import", "{w}/archives/text.tar.zst", "{w}/existing_dir"], 2, "exists", []),
        ("import-readonly-destination", ["import", "{w}/archives/text.tar.zst", "{ro}/i"], 2, "{ro}", []),
    ]
    return cases


def _mirror_cases():
    """``mirror`` and ``import URL`` on what fails before any network call (the local S3 server's
    cases are in tests/tiers/test_mirror.py)."""
    return [
        ("mirror-missing-run", ["mirror", "{w}/nope", "s3://bkt/x"], 2, "no such", []),
        ("mirror-file-for-run", ["mirror", f"{{w}}/good/{B}", "s3://bkt/x"], 2, "not a run directory", []),
        ("mirror-two-local-paths", ["mirror", "{w}/run", "{w}/mirrored"], 2, "one url", ["{w}/mirrored"]),
        ("mirror-url-existing-destination", ["mirror", "s3://bkt/x", "{w}/existing_dir"], 2, "exists", []),
        ("import-url-existing-destination", ["import", "s3://bkt/x", "{w}/existing_dir"], 2, "exists", []),
    ]


CASES = _cases()


def _snapshot(root):
    """Every entry under root: kind and, for files, a digest of the bytes and the mode. A free
    ``.lock`` is left out: a command that writes to a run takes its flock on RUN/.lock
    (spec/RUN.md §3), and a lock file stays once released, empty or, after a first writer that
    wrote no generation (gc, pivot), ``{"never_written": true}`` (RUN.md §2.2)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if name == ".lock" and open(p, "rb").read() in (b"", b'{"never_written": true}'):
                continue
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mode)
    return out


def _strict_json(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON (RFC 8259)")
    return json.loads(text, parse_constant=refuse)


def _invoke(argv, catch=True):
    from click.testing import CliRunner
    return CliRunner().invoke(main, argv, catch_exceptions=catch)


RUNS = [(case, as_json) for case in CASES for as_json in (False, True)
        if not (as_json and case[1][0] in NO_JSON)]


@pytest.mark.parametrize("case,as_json", RUNS, ids=[f"{c[0]}-{'json' if j else 'human'}" for c, j in RUNS])
def test_contract(world, readonly, case, as_json):
    name, argv, code, word, gone = case
    if name == "diff-zero-norm":
        w = np.zeros(10, dtype="<f4")
        ckptfmt.save(world / "zero_a.bin", 1, w, w, w, write_manifest=False)
        w2 = w.copy()
        w2[3] = 1.0
        ckptfmt.save(world / "zero_b.bin", 1, w2, w, w, write_manifest=False)
    subs = {"w": str(world), "ro": readonly}
    args = [a.format(**subs) for a in argv] + (["--json"] if as_json else [])
    before = _snapshot(world)
    result = _invoke(args)
    where = f"{name}: exit {result.exit_code}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{where}\n{result.exc_info and ''.join(__import__('traceback').format_exception(*result.exc_info))}"
    assert "Traceback" not in result.output, where
    for doubled in ("step None", "DAMAGED (damaged)", "no valid generation: no valid generation"):
        assert doubled not in result.output, f"{where}\nsays {doubled!r}"
    codes = code if isinstance(code, tuple) else (code,)
    assert result.exit_code in codes, where
    errors = [line for line in result.stderr.splitlines() if not line.startswith("ckptfmt: warning:")]
    if result.exit_code == 0 and word:
        assert word.lower() in result.stdout.lower(), f"{where}\nexpected {word!r} in the output"
    if result.exit_code != 0:
        _assert_failure(result, errors, as_json, word.format(**subs), where)
        assert _snapshot(world) == before, f"{where}\nsomething changed: " + \
            str(set(_snapshot(world).items()) ^ set(before.items()))
    for path in gone:
        assert not os.path.lexists(path.format(**subs)), f"{where}\nleft behind: {path}"
    if as_json:
        _strict_json(result.stdout)


def _assert_failure(result, errors, as_json, word, where):
    if errors:
        assert len(errors) == 1, where
        assert errors[0].startswith("ckptfmt: "), where
        assert word.lower() in errors[0].lower(), f"{where}\nexpected {word!r} in the message"
        if as_json:
            doc = _strict_json(result.stdout)
            assert isinstance(doc, dict) and isinstance(doc.get("error"), dict), where
            assert doc["error"]["exit_code"] == result.exit_code and doc["error"]["message"], where
    else:   # a check that ran and found a defect or difference: its report says so on stdout
        assert result.exit_code == 1 and result.stdout.strip(), where
        if word:
            assert word.lower() in result.stdout.lower(), f"{where}\nexpected {word!r} in the report"


# ---------------------------------------------------------------- messages and markers
def test_a_text_file_renamed_bin_is_named_both_ways_and_a_torn_file_is_truncated(world):
    assert len(TEXT) == 135
    result = _invoke(["validate", str(world / "files" / "text.bin")])
    assert result.exit_code == 1 and "DAMAGED" in result.stdout
    assert ("text.bin: truncated, or not a ckptfmt checkpoint: header promises 23,379,187,004 bytes, "
            "file has 135") in result.stdout
    result = _invoke(["inspect", str(world / "files" / "truncated.bin")])
    assert result.exit_code == 1 and result.stderr.strip().endswith("truncated: expected 128 bytes, got 120")


def test_a_run_stopped_before_its_first_checkpoint_is_not_called_damaged(world):
    result = _invoke(["validate", str(world / "hist_only")])
    assert result.exit_code == 1 and "DAMAGED" not in result.stdout
    assert result.stdout.startswith(f"{world / 'hist_only'}: NO CHECKPOINT")
    assert "history holds 3 steps but no generation was committed; nothing to resume, a restart begins " \
           "at step 0" in result.stdout
    doc = json.loads(_invoke(["validate", str(world / "hist_only"), "--json"]).stdout)
    assert doc["status"] == "no checkpoint" and doc["findings"][0]["code"] == "no_checkpoint_yet"


def test_an_incomplete_export_or_import_is_never_valid(world):
    """A destination that still carries EXPORT-INCOMPLETE fails validate (exit 1, saying so),
    whatever its files say; so does a file in it. Without the marker the same files are valid."""
    from ckptfmt.tools.archive import archive, import_archive
    from ckptfmt.tools.export import export
    export(str(world / "run"), str(world / "exported"))
    archive(str(world / "run"), str(world / "run.tar.zst"))
    import_archive(str(world / "run.tar.zst"), str(world / "imported"))
    for dest in ("exported", "imported"):
        assert _invoke(["validate", str(world / dest)]).exit_code == 0
        (world / dest / "EXPORT-INCOMPLETE").write_text("export in progress or failed; do not use\n")
        for target in (world / dest, world / dest / "step_000002.bin"):
            result = _invoke(["validate", str(target)])
            assert result.exit_code == 1 and "DAMAGED" in result.stdout, result.stdout
            assert f"{world / dest / 'EXPORT-INCOMPLETE'}: the export or import into" in result.stdout
            assert "did not finish (or failed)" in result.stdout
            doc = json.loads(_invoke(["validate", str(target), "--json"]).stdout)
            assert not doc["ok"] and "incomplete_export" in [f["code"] for f in doc["findings"]]


def test_a_failed_import_leaves_no_staging_directory(world):
    """The staging directory of an import is removed when the import fails."""
    result = _invoke(["import", str(world / "archives" / "nomanifest.tar.zst"), str(world / "imported")])
    assert result.exit_code == 1
    assert not [p for p in os.listdir(world) if p.startswith(".ckptfmt-tmp.")]
    assert not (world / "imported").exists()


def test_a_fork_copies_a_nan_literal_as_the_string_nan_and_a_failed_fork_leaves_nothing(world):
    """A history line with a NaN literal (no writer writes one) is forked as "nan" (strict JSON,
    spec/RUN.md §3.1); a fork whose history cannot be read leaves no DEST and no staging."""
    assert _invoke(["fork", str(world / "hist_nanlit"), str(world / "forked"), "--step", "3"]).exit_code == 0
    lines = [json.loads(line) for line in (world / "forked" / ".loss.json").read_text().splitlines()]
    assert [rec.get("loss") for rec in lines if "event" not in rec] == [5.0, "nan", 4.0]
    assert _invoke(["validate", str(world / "forked")]).exit_code == 0
    result = _invoke(["fork", str(world / "hist_dir"), str(world / "forked2"), "--step", "1"])
    assert result.exit_code == 2 and not (world / "forked2").exists()
    assert not [p for p in os.listdir(world) if p.startswith(".ckptfmt-tmp.")]


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (root mounts it, as the read-only fixture does) and a 600 KB checkpoint."""
    with small_tmpfs(tmp_path / "full") as mnt:
        yield mnt, _save(str(tmp_path / "big"), 1, n=50_000)


@pytest.mark.parametrize("name", ["x.npz", "x.pt", "x.zst", "x.ckz", "x.safetensors", B])
def test_a_full_disk_is_named_and_leaves_nothing(full_disk, name):
    """Writers that go through a file object (npz, torch.save, zstd) name the destination when
    the disk is full (the file object's ENOSPC names no file; torch.save makes a RuntimeError
    of it): exit 2, one line, nothing left behind."""
    mnt, src = full_disk
    for as_json in (False, True):
        result = _invoke(["convert", src, str(mnt / name)] + (["--json"] if as_json else []))
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        line, = result.stderr.splitlines()
        assert line.startswith(f"ckptfmt: {mnt / name}") and "No space left on device" in line, line
        if as_json:
            assert _strict_json(result.stdout)["error"]["exit_code"] == 2
        assert os.listdir(mnt) == []
    result = _invoke(["fork", os.path.dirname(src), str(mnt / "forked"), "--step", "1"])
    assert result.exit_code == 2 and os.listdir(mnt) == [], result.output
    assert result.stderr.startswith(f"ckptfmt: {mnt / 'forked'}/") and ".ckptfmt-tmp" not in result.stderr, result.stderr


def test_an_error_no_check_anticipated_is_one_line_exit_2(tmp_path, monkeypatch):
    """The last safety net: a defect of ours (here a KeyError planted in ls) is one line naming
    it, exit 2, with --json one document; CKPTFMT_DEBUG=1 (set for the suite) shows the traceback."""
    import ckptfmt.run.ops

    def broken(*args, **kwargs):
        raise KeyError("shards")
    monkeypatch.setattr(ckptfmt.run.ops, "ls_run", broken)
    with pytest.raises(KeyError):
        _invoke(["ls", str(tmp_path)], catch=False)
    monkeypatch.delenv("CKPTFMT_DEBUG")
    result = _invoke(["ls", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr == (
        "ckptfmt: internal error: KeyError: 'shards' (a defect of ckptfmt, please report it; "
        "CKPTFMT_DEBUG=1 shows the traceback)\n") and "Traceback" not in result.output
    doc = json.loads(_invoke(["ls", str(tmp_path), "--json"]).stdout)
    assert doc["error"]["type"] == "InternalError" and doc["error"]["exit_code"] == 2
    monkeypatch.setenv("CKPTFMT_DEBUG", "0")                    # 0 is off, as unset
    assert _invoke(["ls", str(tmp_path)]).stderr.startswith("ckptfmt: internal error: KeyError")


# Every command: exit codes 0/1/2, --json shapes, one-line errors and no tracebacks, case by case.

XY_LAYOUT = [{"name": "x", "shape": [60], "offset": 0}, {"name": "y", "shape": [40], "offset": 60}]


def run(runner, *args):
    result = runner.invoke(main, list(map(str, args)), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture
def bad(tmp_path):
    """Named malformed inputs."""
    good = make(tmp_path, 1, n=10)
    data = good.read_bytes()
    files = {
        "truncated": data[:-3],
        "trailing": data + b"\0",
        "negative_step": struct.pack("<ii", -1, 0),
        "negative_n": struct.pack("<ii", 1, -1),
        "not_a_checkpoint": b"hello, this is a text file\n",
        "empty": b"",
    }
    out = {}
    for name, content in files.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        out[name] = p
    corrupt = tmp_path / "cm"
    corrupt.mkdir()
    cm = make(corrupt, 1, n=10)
    (corrupt / "step_000001.json").write_text("{broken")
    out["corrupt_manifest"] = cm
    return out


def test_help_lists_every_command(runner):
    code, out = run(runner, "--help")
    for cmd in ("inspect", "validate", "diff", "convert", "ls", "gc", "pin", "pivot", "fork", "bisect",
                "plot", "train", "verify-resume", "export", "import", "mirror"):
        assert cmd in out
    assert code == 0


def test_inspect_json_shape(runner, tmp_path):
    w, m, v = arrays(100)
    w[0], m[1] = np.nan, np.inf
    ckptfmt.save(tmp_path / "step_000005.bin", 5, w, m, v, manifest={"layout": XY_LAYOUT})
    code, out = run(runner, "inspect", tmp_path / "step_000005.bin", "--json", "--tensors")
    d = json.loads(out)
    assert code == 0 and d["step"] == 5 and d["n_params"] == 100 and d["size"] == 1208
    assert set(d["regions"]) == {"weights", "m", "v"} and d["fingerprint"] == "verified"
    assert d["regions"]["weights"]["nan"] == 1 and d["regions"]["m"]["inf"] == 1
    assert set(d["tensors"]) == {"x", "y"}
    code, out = run(runner, "inspect", tmp_path / "step_000005.bin")
    assert code == 0 and "fingerprint verified" in out and "weights" in out


def test_inspect_reports_mismatch_and_unverified(runner, tmp_path):
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[20] ^= 1
    path.write_bytes(bytes(data))
    assert json.loads(run(runner, "inspect", path, "--json")[1])["fingerprint"] == "mismatch"
    (tmp_path / "step_000001.json").unlink()
    assert json.loads(run(runner, "inspect", path, "--json")[1])["fingerprint"] == "unverified"


@pytest.mark.parametrize("name", ["truncated", "trailing", "negative_step", "negative_n", "not_a_checkpoint", "empty"])
@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_damaged_inputs_exit_1_with_one_line(runner, bad, name, command):
    code, out = run(runner, command, bad[name])
    assert code == 1, out
    assert "Traceback" not in out and str(bad[name]) in out


def test_corrupt_manifest(runner, bad):
    code, out = run(runner, "validate", bad["corrupt_manifest"])
    assert code == 1 and "not valid JSON" in out
    code, out = run(runner, "inspect", bad["corrupt_manifest"], "--json")
    d = json.loads(out)       # a manifest that cannot be read is not a fingerprint mismatch
    assert code == 0 and d["fingerprint"] == "unchecked" and "not valid JSON" in d["manifest_problem"]


@pytest.mark.parametrize("args", [["inspect", "{missing}"], ["validate", "{missing}"], ["diff", "{missing}", "{file}"],
                                  ["diff", "{dir}", "{file}"], ["convert", "{missing}", "{dir}/x.npz"],
                                  ["ls", "{missing}"], ["ls", "{file}"], ["gc", "{dir}"], ["gc", "{dir}", "--keep-last", "0"],
                                  ["convert", "{file}", "{dir}/x.npz", "--dtype", "float16"], ["frobnicate"]])
def test_cannot_run_exits_2(tmp_path, args):
    f = make(tmp_path, 1)
    subs = {"missing": tmp_path / "nope.bin", "file": f, "dir": tmp_path}
    proc = cli(*[a.format(**subs) for a in args])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def test_one_line_errors_in_a_real_process(tmp_path):
    proc = cli("inspect", str(tmp_path / "nope.bin"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "nope.bin" in proc.stderr


@pytest.mark.parametrize("args", [["inspect", "{file}", "--tensors"], ["validate", "{file}", "--json"]])
def test_a_reader_that_closes_stdout_ends_the_command_quietly(tmp_path, args):
    """`ckptfmt inspect RUN --tensors | head`: stdout's pipe is closed before the command writes;
    no "[Errno 32] Broken pipe" naming no file, no traceback, no "Exception ignored" at exit."""
    import os
    import subprocess
    from conftest import PY
    f = make(tmp_path, 1)
    read_end, write_end = os.pipe()
    os.close(read_end)                                  # the reader is gone before the first write
    try:
        proc = subprocess.run([PY, "-m", "ckptfmt.cli", *[a.format(file=f) for a in args]], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 2 and proc.stderr == ""


def test_a_usage_error_names_the_command_once(tmp_path):
    proc = cli("gc", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr == ("ckptfmt: gc: Missing a keep rule: --keep-last, --keep-every, "
                                                    "--keep-best, --keep-within or --keep-interval (the guards "
                                                    "alone are no policy). (see --help)\n")


def test_validate_many_and_json(runner, tmp_path, bad):
    good = make(tmp_path, 2)
    code, out = run(runner, "validate", good, "--json")
    d = json.loads(out)
    assert code == 0 and d["ok"] and d["status"] == "verified"
    code, out = run(runner, "validate", good, bad["truncated"], "--json")
    assert code == 1 and [r["ok"] for r in json.loads(out)] == [True, False]
    assert run(runner, "validate", "--fast", good)[0] == 0


def test_diff_exit_codes_and_json(runner, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    w, m, v = arrays(100)
    ckptfmt.save(a / "step_000001.bin", 1, w, m, v, manifest={"layout": XY_LAYOUT})
    ckptfmt.save(b / "step_000001.bin", 1, w, m, v, manifest={"layout": XY_LAYOUT})
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--json")
    assert code == 0 and json.loads(out)["identical"] is True
    v2 = v.copy()
    v2[70] *= 1.0001
    ckptfmt.save(b / "step_000001.bin", 1, w, m, v2, manifest={"layout": XY_LAYOUT}, overwrite=True)
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--json", "--tensors")
    d = json.loads(out)
    assert code == 1 and d["identical"] is False and d["regions"]["v"]["first_param"] == "y"
    assert d["tensors"] == {"y": {"v": 1}}
    code, out = run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin")
    assert code == 1 and "y[10]" in out
    assert run(runner, "diff", a / "step_000001.bin", b / "step_000001.bin", "--rtol", "1e-3")[0] == 0


def test_convert_round_trip_and_refusal(runner, tmp_path):
    src = make(tmp_path, 3)
    code, out = run(runner, "convert", src, tmp_path / "x.zst", "--json")
    assert code == 0 and json.loads(out)["verified"] == "round-trip"
    back = tmp_path / "b" / "step_000003.bin"
    back.parent.mkdir()
    assert run(runner, "convert", tmp_path / "x.zst", back)[0] == 0
    assert back.read_bytes() == src.read_bytes()
    proc = cli("convert", str(src), str(tmp_path / "x.zst"))
    assert proc.returncode == 2 and "exists already" in proc.stderr


def test_ls_gc_pin(runner, tmp_path):
    for s in (100, 200, 300, 400, 500):
        make(tmp_path, s, seed=s)
    (tmp_path / ".ckptfmt-tmp.step_000600.bin.1.dead").write_bytes(b"x")
    code, out = run(runner, "ls", tmp_path, "--json")
    d = json.loads(out)
    assert code == 0 and [g["step"] for g in d["generations"]] == [100, 200, 300, 400, 500]
    assert len(d["leftovers"]) == 1
    lines = run(runner, "ls", tmp_path)[1].splitlines()
    assert lines[1].split() == ["step", "size", "age", "status"] and lines[2].split()[0] == "100"
    assert run(runner, "pin", tmp_path, 100)[0] == 0
    rows = json.loads(run(runner, "ls", tmp_path, "--json", "--keep-every", "200")[1])["generations"]
    assert [r["step"] for r in rows if r["milestone"]] == [200, 400] and [r["step"] for r in rows if r["pinned"]] == [100]
    code, out = run(runner, "gc", tmp_path, "--keep-last", "2", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [200, 300]
    assert (tmp_path / "step_000200.bin").exists()
    code, out = run(runner, "gc", tmp_path, "--keep-last", "2", "--json")
    assert json.loads(out)["deleted"] == [200, 300] and len(json.loads(out)["swept_temps"]) == 1
    assert sorted(p.name for p in tmp_path.glob("step_*.bin")) == ["step_000100.bin", "step_000400.bin", "step_000500.bin"]


def test_version(runner):
    code, out = run(runner, "--version")
    assert code == 0 and ckptfmt.__version__ in out


def test_inspect_of_a_run_without_a_valid_generation(tmp_path):
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data[:-4]))
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 1 and "no valid generation" in proc.stdout
    assert "ckptfmt: warning: " in proc.stderr and "Traceback" not in proc.stderr


def test_a_command_run_in_process_prints_one_line_warnings_and_leaves_the_programs_format(runner, tmp_path):
    """The one-line format is the command's, while it runs: importing the CLI or running a
    command in a program's own process leaves that program's warnings.formatwarning as it was."""
    import warnings
    path = make(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data[:-4]))
    before = warnings.formatwarning
    import ckptfmt.cli  # noqa: F401
    assert warnings.formatwarning is before
    with warnings.catch_warnings():          # as a program shows warnings, whatever pytest records
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        result = runner.invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and "ckptfmt: warning: " in result.stderr, result.stderr
    assert warnings.formatwarning is before and not warnings.formatwarning.__module__.startswith("ckptfmt")


def test_non_finite_values_produce_no_numpy_warnings(tmp_path):
    w, m, v = arrays(100)
    w[:2] = [np.inf, -np.inf]
    m[5] = np.nan
    ckptfmt.save(tmp_path / "step_000001.bin", 1, w, m, v)
    ckptfmt.save(tmp_path / "b.bin", 1, v, m * 0, w)
    for args in (["validate", "step_000001.bin"], ["inspect", "step_000001.bin"], ["diff", "step_000001.bin", "b.bin"]):
        proc = cli(*args, cwd=tmp_path)
        assert proc.returncode in (0, 1) and "Warning" not in proc.stderr and "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("value, says", [
    ('caps={"code":0.5}', "sources ['topics', 'docstrings'] need caps and floors"),   # the help's example, cut short
    ('ctx="x"', "--set: ctx must be an integer >= 1, got 'x'"),
    ("betas=1", "--set: betas must be two numbers in [0, 1), got 1"),
    ("lr=-1", "--set: lr must be a finite number >= 0, got -1"),
    ('sources=["code","pictures"]', "sources must be a non-empty list of code, topics, docstrings"),
    ('caps={"code":0.2,"topics":0.2,"docstrings":0.2}', "caps to at least 1"),
])
def test_train_refuses_a_bad_set_in_one_line_before_the_run_exists(tmp_path, value, says):
    """A --set value of the wrong type or one the bandit cannot use was a traceback (exit 1) from
    deep in the trainer, after the run directory and its lock were made."""
    proc = cli("train", "--run", str(tmp_path / "run"), "--steps", "2", "--set", value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ckptfmt: ") and says in proc.stderr
    assert not (tmp_path / "run").exists()



@pytest.mark.parametrize("command", ["validate", "inspect", "diff", "convert", "export", "fork"])
def test_an_io_error_that_names_no_file_is_one_line_naming_a_path(tmp_path, monkeypatch, command):
    """A read failing on an open file (EIO from the disk: the OSError names no file) is one line
    that names a path (the file, or else the one the command was given), never a traceback; a
    file command exits 2 (it could not judge the file), export and fork exit 1 (the run has no
    generation they can read)."""
    run = tmp_path / "run"
    run.mkdir()
    make(run, 5, n=8)
    src = str(run / "step_000005.bin")

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(ckptfmt.reader, "open", failing)
    monkeypatch.setattr(ckptfmt.fingerprint, "of_file", failing)
    argv = {"validate": [src], "inspect": [src], "diff": [src, src], "convert": [src, str(tmp_path / "o.safetensors")],
            "export": [str(run), str(tmp_path / "exp")], "fork": [str(run), "--step", "5", str(tmp_path / "child")]}
    proc = cli(command, *argv[command])
    said = (proc.stdout + proc.stderr).strip()
    assert "Traceback" not in said and "Input/output error" in said, said
    lines = [line for line in said.splitlines() if "Input/output error" in line]
    assert all(str(tmp_path) in line for line in lines), said
    # a command that needs a valid generation finds none it can read: "no valid generation", exit 1
    assert proc.returncode == (1 if command in ("export", "fork") else 2), said


@pytest.mark.parametrize("argv", [
    ("convert", "{run}/step_000005.bin", "s3://b/x.safetensors"),
    ("convert", "s3://b/r/step_000005.bin", "{tmp}/x.safetensors"),
    ("export", "{run}", "s3://b/exported"),
    ("export", "{run}", "s3://b/x.tar.zst", "--archive"),
    ("plot", "{run}", "--out", "s3://b/loss.png"),
    ("validate", "{run}", "--b3sums", "s3://b/B3SUMS"),
    ("verify-resume", "--output", "s3://b/proof", "--steps", "4", "--cut", "2"),
])
def test_a_url_where_a_local_path_is_taken_is_refused_and_nothing_is_made(tmp_path, monkeypatch, argv):
    """pathlib would make s3://b/r the local directory s3:/b/r: a run would train and save
    there and diff would compare the local file, all exit 0. Refused in one line, exit 2, and
    nothing is written in the working directory."""
    run = tmp_path / "run"
    run.mkdir()
    make(run, 5, n=8)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    proc = cli(*[a.format(run=run, tmp=tmp_path) for a in argv], cwd=work)
    said = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and "a URL where" in said and len(said.splitlines()) == 1, said
    assert list(work.iterdir()) == [] and not (tmp_path / "x.safetensors").exists()


def test_a_manager_given_a_url_without_credentials_says_so_before_anything_is_made(tmp_path, monkeypatch):
    """A URL is a run on object storage, never the local directory s3:/bucket/...: without
    credentials the manager stops at its construction, in one line naming the URL."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("s3fs")
    from ckptfmt.errors import RemoteError
    from ckptfmt.torch import CheckpointManager
    monkeypatch.chdir(tmp_path)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RemoteError, match=r"^s3://bucket/runs/x: .*no credentials"):
        CheckpointManager("s3://bucket/runs/x", model, torch.optim.AdamW(model.parameters()), handle_signals=False)
    assert list(tmp_path.iterdir()) == []
