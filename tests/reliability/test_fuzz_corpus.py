"""Replay the committed fuzzing corpus (RELIABILITY.md item 13): 0 uncaught exceptions."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fuzz"))

from target import one_input  # noqa: E402


def test_corpus_replays_without_uncaught_exceptions():
    files = sorted((ROOT / "fuzz" / "corpus").iterdir())
    assert len(files) >= 6
    for f in files:
        one_input(f.read_bytes())


def test_random_mutations_raise_only_checkpoint_errors():
    import random
    rng = random.Random(0)
    seeds = [f.read_bytes() for f in sorted((ROOT / "fuzz" / "corpus").iterdir())]
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            if data and rng.random() < 0.7:
                data[rng.randrange(len(data))] = rng.randrange(256)
            else:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
        one_input(bytes(data))


def test_conversion_and_archive_readers_have_seeds():
    """The corpus covers the readers of the conversions (.npz, .safetensors, .zst, .pt) and of
    export archives: each selector byte has a seed written by fuzz/seeds.py."""
    from target import ARCHIVE, CONVERSION_READERS, TORCH
    firsts = {f.read_bytes()[:1] for f in (ROOT / "fuzz" / "corpus").iterdir()}
    for selector in (*CONVERSION_READERS, ARCHIVE, TORCH):
        assert bytes([selector]) in firsts, hex(selector)
