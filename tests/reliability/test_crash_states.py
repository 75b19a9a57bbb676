"""A pure-Python crash-state enumerator (RELIABILITY.md item 5), in the spirit of ALICE and
LevelDB's fault-injection env: record every filesystem operation of one save + history append +
prune, then build every state a crash could leave and check the loader on each.

What may be lost at a crash (ext4-like rules, deliberately pessimistic):
* data written to a file but not yet fsynced: dropped entirely, kept up to any 4 KiB or 512 B
  boundary, or kept with a garbage tail;
* namespace operations (create, rename, link, unlink) not yet made durable by an fsync of their
  directory: any prefix of them in program order survives (later ones are reverted).
A state is bad if the loader accepts a torn generation, finds no valid generation, or the
history shows corruption in the middle.
"""
import os
import shutil
from pathlib import Path


import ckptfmt
from ckptfmt import fsio
from ckptfmt.run import history as hist
from ckptfmt.errors import NoValidGenerationError
from ckptfmt.run import Run
from faults import arrays, expected_digest

N = 1500


class Recorder:
    """Shadow model of the directory: durable vs volatile contents and names."""

    def __init__(self, root: Path):
        self.root = root
        self.log: list[tuple] = []

    def snapshot_file(self, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return b""

    def hook(self, op: str, path: str) -> None:
        # Called *before* the operation; record what is on disk before it, so a crash "at"
        # this operation sees everything earlier but not this one.
        self.log.append((op, path, {p.name: p.read_bytes() for p in self.root.iterdir() if p.is_file()}))


def crash_states(log: list[tuple], final: dict[str, bytes]):
    """Yield (description, {name: bytes}) for every crash point and loss pattern.

    snaps[i] is the directory just before operation i. ``synced`` holds each name's content as
    of its last fsync (a rename or a hard link carries it to the new name); ``durable`` is the namespace as of
    the last directory fsync, with the content each name had durably then.
    """
    snaps = [entry[2] for entry in log] + [final]
    synced = dict(snaps[0])                  # the starting state was fully durable
    durable = dict(snaps[0])
    for i, visible in enumerate(snaps):
        yield f"op{i}:as-written", dict(visible)
        for name, data in visible.items():   # unsynced data: dropped, torn or garbage-tailed
            base = synced.get(name, b"")
            if data != base:
                for variant, content in _data_variants(base, data):
                    yield f"op{i}:{name}:{variant}", {**visible, name: content}
        for name in visible.keys() - durable.keys():          # an unsynced create or rename target
            yield f"op{i}:lost-name:{name}", {k: v for k, v in visible.items() if k != name}
        for name in durable.keys() - visible.keys():          # an unsynced unlink or rename source
            yield f"op{i}:back:{name}", {**visible, name: durable[name]}
        for name in visible.keys() & durable.keys():          # a rename over a durable name, reverted
            if visible[name] != durable[name] and name != hist.NAME:
                yield f"op{i}:reverted:{name}", {**visible, name: durable[name]}
        if i == len(log):
            break
        op, path, _ = log[i]
        name, nxt = os.path.basename(path), snaps[i + 1]
        if op == "fsync":
            synced[name] = nxt.get(name, b"")
        elif op == "rename":
            gone = [k for k in visible.keys() - nxt.keys()]
            if gone:
                synced[name] = synced.pop(gone[0], b"")
        elif op == "link":                   # a new name for a file: it carries that file's synced data
            source = next((k for k in visible if k != name and visible[k] == nxt.get(name)), None)
            synced[name] = synced.get(source, b"")
        elif op == "unlink":
            synced.pop(name, None)
        elif op == "fsync_dir":
            durable = {k: synced.get(k, b"") for k in nxt}


def _data_variants(old: bytes, new: bytes):
    yield "dropped", old
    for block in (512, 4096):
        for cut in range(block, len(new), block):
            yield f"cut{cut}", new[:cut]
    if len(new) > 64:
        yield "garbage-tail", new[:-64] + bytes(range(64))
        yield "nul-tail", new[:-64] + bytes(64)


def test_every_crash_state_of_a_save_prune_and_history_append(tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    run = Run(live)
    run.commit(1, *arrays(N, 1), manifest={})
    run.history.append({"step": 1, "loss": 1.0})
    run.history.sync()
    run.commit(2, *arrays(N, 2), manifest={})
    run.history.append({"step": 2, "loss": 0.5})
    run.history.sync()
    run.history.close()
    rec = Recorder(live)
    fsio.hook = rec.hook
    try:
        run = Run(live)
        run.history.append({"step": 3, "loss": 0.25})
        run.commit(3, *arrays(N, 3), manifest={})
        run.history.sync()
        run.gc(keep_last=1)
        run.history.close()
    finally:
        fsio.hook = None
    final = {p.name: p.read_bytes() for p in live.iterdir() if p.is_file()}
    checked = bad = 0
    scratch = tmp_path / "state"
    for desc, state in crash_states(rec.log, final):
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        for name, data in state.items():
            (scratch / name).write_bytes(data)
        checked += 1
        try:
            gen = Run(scratch).latest(deep=True)
            ok = gen is not None and gen.step in (1, 2, 3) and \
                ckptfmt.open(gen.bin, verify=True).fingerprint() == expected_digest(gen.step, N)
        except NoValidGenerationError:
            ok = False
        history = hist.read(scratch / ".loss.json")
        if not ok or history.problems:
            bad += 1
            print("BAD", desc)
    print("crash states checked:", checked)
    assert checked >= 150
    assert bad == 0, f"{bad} of {checked} crash states were bad"
