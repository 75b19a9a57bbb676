"""Device tensors reach the writer through one save's staging pair, the copy of the
next piece overlapped with the writing of this one (spec/FORMAT.md §5.7.2).

The CUDA calls live in ``staging.CudaCopies``; these tests drive the same ``Stager`` with its CPU
twin ``HostCopies``, whose copies land at launch (a launch into a buffer still handed out would
show in its bytes), only at wait (a buffer handed out before its wait would hold old bytes) or
late on a thread, and check every buffer against the tensors it came from.
"""
from __future__ import annotations

import time

import blake3
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptfmt  # noqa: E402
from ckptfmt import fingerprint, manifest as mf, writer  # noqa: E402
from ckptfmt.torch import adapter, staging  # noqa: E402

CAPACITY = 1000   # floats per staging buffer here: many pieces from small tensors
MODES = [("launch", 0.0), ("wait", 0.0), ("thread", 0.001)]


class Watched:
    """``HostCopies``, watched: every launch is counted against its buffer until waited on, so a
    buffer handed out while a copy into it is still outstanding is seen at once."""

    def __init__(self, at: str, delay_s: float = 0.0):
        self.twin = staging.HostCopies(at, delay_s)
        self.outstanding: dict[int, int] = {}
        self.launches = 0

    def stages(self, tensor):
        return True

    def buffer(self, count):
        return self.twin.buffer(count)

    def launch(self, segments, into):
        self.launches += 1
        ptr = into.data_ptr()
        self.outstanding[ptr] = self.outstanding.get(ptr, 0) + 1
        return ptr, self.twin.launch(segments, into)

    def wait(self, ticket):
        ptr, inner = ticket
        self.twin.wait(inner)
        self.outstanding[ptr] -= 1


def sources(seed: int = 0) -> list:
    """Sizes around the capacity, zero-size tensors, many small ones and a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 999, 1000, 1001, 2500, 0] + [3] * 40 + [CAPACITY * 3, 7]
    tensors = [torch.randn(k, generator=g) for k in sizes]
    tensors.append(torch.randn(37, 29, generator=g).t())   # .contiguous() makes a temporary
    return tensors


def pull(stager: staging.Stager, tensors: list, engine: Watched) -> bytes:
    """Consume a region as the writer does; every buffer must have landed when handed out."""
    out = []
    for array in stager.region(tensors):
        assert engine.outstanding.get(array.__array_interface__["data"][0], 0) == 0, \
            "a buffer was handed out with a copy into it still outstanding"
        out.append(array.tobytes())
    return b"".join(out)


def expected(tensors: list) -> bytes:
    return b"".join(t.contiguous().view(-1).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("at,delay_s", MODES, ids=[m[0] for m in MODES])
def test_every_buffer_has_landed_and_holds_its_tensors_bytes(at, delay_s):
    engine = Watched(at, delay_s)
    stager = staging.Stager(engine, capacity=CAPACITY)
    regions = [sources(seed) for seed in range(3)]        # weights, m, v through one pair
    for tensors in regions:
        assert pull(stager, tensors, engine) == expected(tensors)
    total = sum(t.numel() for t in regions[0])
    assert engine.launches == 3 * -(-total // CAPACITY)   # small tensors share a piece
    assert len(stager._buffers) == 2                      # one pair for the whole save


def test_a_stager_that_refills_the_buffer_it_hands_out_is_caught():
    """The negative control: one buffer instead of the pair, so the copy of piece k+1 is
    launched into piece k's buffer before it is handed out."""

    class OneBuffer(staging.Stager):
        def _launch(self, segments, turn):
            return super()._launch(segments, 0)

    engine = Watched("launch")
    tensors = sources()
    with pytest.raises(AssertionError, match="still outstanding"):
        pull(OneBuffer(engine, capacity=CAPACITY), tensors, engine)
    unwatched = OneBuffer(staging.HostCopies("launch"), capacity=CAPACITY)
    assert b"".join(a.tobytes() for a in unwatched.region(tensors)) != expected(tensors)


def test_pieces_keep_file_order_around_host_tensors():
    """Host tensors are handed out as zero-copy views between staged pieces, in file order."""
    tensors = sources()
    engine = staging.HostCopies("wait")
    engine.stages = lambda t: t.numel() % 2 == 1           # odd sizes "on the device"
    stager = staging.Stager(engine, capacity=CAPACITY)
    got = b"".join(a.tobytes() for a in stager.region(tensors))
    assert got == expected(tensors)
    host = [p for p in staging.plan(tensors, CAPACITY, engine.stages) if isinstance(p, np.ndarray) and p.size]
    even = [t for t in tensors if t.numel() and t.numel() % 2 == 0]
    assert len(host) == len(even) == 3 and all(np.shares_memory(p, t.numpy()) for p, t in zip(host, even))


def test_plan_cuts_pieces_at_the_capacity_and_skips_empty_tensors():
    tensors = [torch.ones(0), torch.ones(1500), torch.ones(0), torch.ones(700), torch.ones(3)]
    pieces = list(staging.plan(tensors, 1000, lambda t: True))
    assert [[s.numel() for s in p] for p in pieces] == [[1000], [500, 500], [200, 3]]
    assert list(staging.plan([torch.ones(0)], 1000, lambda t: True)) == []
    with pytest.raises(TypeError, match="float32"):
        list(staging.plan([torch.ones(3, dtype=torch.bfloat16)], 1000, lambda t: True))


def test_an_abandoned_region_waits_for_its_copy_in_flight():
    engine = Watched("thread", 0.001)
    stager = staging.Stager(engine, capacity=CAPACITY)
    region = stager.region(sources())
    next(region)
    region.close()
    assert set(engine.outstanding.values()) == {0}
    assert pull(stager, sources(1), engine) == expected(sources(1))   # free for the next region


def test_one_stager_serves_one_region_at_a_time():
    stager = staging.Stager(staging.HostCopies("launch"), capacity=CAPACITY)
    first = stager.region(sources())
    next(first)
    with pytest.raises(RuntimeError, match="one region at a time"):
        next(stager.region(sources()))


def test_the_cuda_engine_copies_synchronously_from_a_device_without_streams():
    """What of ``CudaCopies`` runs without a GPU: host tensors are not staged, and a source on
    a device without CUDA streams is copied at launch."""
    engine = staging.CudaCopies()
    assert not engine.stages(torch.ones(2))
    buf = engine.buffer(8)
    assert buf.dtype == torch.float32 and buf.numel() == 8
    ticket = engine.launch([torch.arange(3.0), torch.arange(4.0)], buf)
    engine.wait(ticket)
    assert buf[:7].tolist() == [0, 1, 2, 0, 1, 2, 3]


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.LayerNorm(29), torch.nn.Linear(29, 3),
                                *[torch.nn.Linear(3, 3) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 37)).pow(2).mean().backward()
        opt.step()
    return model, opt


class SlowHasher:
    """Hashing slower than copying: a producer resumed before its buffer was hashed would refill
    it under the hasher, and the manifest's digest would not be the file's."""

    def __init__(self, real):
        self.real = real

    def update(self, data):
        time.sleep(0.002)
        self.real.update(data)

    def hexdigest(self):
        return self.real.hexdigest()


@pytest.mark.parametrize("at,delay_s", [("launch", 0.0), ("thread", 0.003)], ids=["eager", "slow-copies"])
def test_the_writer_saves_exactly_the_tensors_through_the_twin(tmp_path, monkeypatch, at, delay_s):
    real = fingerprint.hasher
    monkeypatch.setattr(fingerprint, "hasher", lambda threads=1: SlowHasher(real(threads)))
    model, opt = model_and_optimizer()
    engine = Watched(at, delay_s)
    w, m, v, n, step = adapter.regions(model, opt, staging.Stager(engine, capacity=CAPACITY))
    path = tmp_path / "step_000002.bin"
    result = writer.save(path, step, w, m, v, n_params=n,
                         manifest={"layout": adapter.layout_of(model),
                                   "optimizer": {"type": "AdamW", "step": step,
                                                 "hyperparams": adapter.hyperparams(opt)}})
    data = path.read_bytes()
    assert result.blake3 == blake3.blake3(data).hexdigest() == mf.read(mf.path_for(path))["blake3"]
    assert engine.launches == 3 * -(-n // CAPACITY) and set(engine.outstanding.values()) == {0}
    assert adapter.differing_tensors(str(path), model, opt) == []
    assert ckptfmt.validate(str(path)).ok


def test_differing_tensors_names_the_tensor_whose_bytes_differ(tmp_path):
    model, opt = model_and_optimizer()
    path = str(tmp_path / "step_000002.bin")
    adapter.save(path, model, opt)
    assert adapter.differing_tensors(path, model, opt) == []
    with torch.no_grad():
        model[2].bias[1] += 1
    opt.state[model[0].weight]["exp_avg_sq"][3, 4] = 0.5
    assert adapter.differing_tensors(path, model, opt) == ["weights:2.bias", "v:0.weight"]


def test_differing_tensors_compares_a_managers_bf16_save(tmp_path):
    """The manager's synchronous save stages each parameter through the save's pair after a
    widening cast made as the piece is pulled; the file holds the live values, widened."""
    from ckptfmt.torch import CheckpointManager
    model, opt = model_and_optimizer()
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 37, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path / "run", model, opt, handle_signals=False, every=None)
    mgr.close(1)
    assert adapter.differing_tensors(str(tmp_path / "run" / "step_000001.bin"), model, opt) == []
