import warnings

import pytest

torch = pytest.importorskip("torch")

import ckptfmt  # noqa: E402
import ckptfmt.torch as ct  # noqa: E402
from ckptfmt.errors import UnsupportedOptimizerError, CheckpointError, IncompleteResumeStateError  # noqa: E402


def model_and_opt(seed=0, cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return m, cls(m.parameters(), lr=0.01, betas=(0.9, 0.999), weight_decay=0.05)


def train(m, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = m(torch.randn(6, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_save_load_then_continue_bit_exactly(tmp_path, cls):
    m, opt = model_and_opt(cls=cls)
    train(m, opt, 3)
    r = ct.save(str(tmp_path / "step_000003.bin"), m, opt)
    assert r.step == 3 and r.n_params == sum(p.numel() for p in m.parameters())
    ck = ckptfmt.open(r.path)
    assert ck.m.tobytes() == torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in m.parameters()]).numpy().tobytes()
    assert ck.manifest["optimizer"]["step"] == 3 and [e["name"] for e in ck.layout] == [n for n, _ in m.named_parameters()]
    m2, opt2 = model_and_opt(seed=5, cls=cls)
    opt2.param_groups[0]["lr"] = 0.9
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no read-only-array warning from torch
        ct.load(r.path, m2, opt2)
    assert opt2.param_groups[0]["lr"] == 0.01
    train(m, opt, 4, seed=2)
    train(m2, opt2, 4, seed=2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_step_zero_checkpoint_resumes_like_a_fresh_optimizer(tmp_path):
    m, opt = model_and_opt()
    r = ct.save(str(tmp_path / "step_000000.bin"), m, opt)
    assert not ckptfmt.open(r.path).m.any()
    m2, opt2 = model_and_opt(seed=3)
    ct.load(r.path, m2, opt2)
    train(m, opt, 2)
    train(m2, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_loader_refuses_mismatches(tmp_path):
    m, opt = model_and_opt()
    train(m, opt, 1)
    r = ct.save(str(tmp_path / "step_000001.bin"), m, opt)
    other = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    with pytest.raises(CheckpointError):
        ct.load(r.path, other)
    ckptfmt.save(tmp_path / "step_000002.bin", 2, *(ckptfmt.open(r.path).weights,) * 3)
    with pytest.raises(IncompleteResumeStateError, match="lacks layout"):
        ct.load(str(tmp_path / "step_000002.bin"), m)
    with pytest.raises(UnsupportedOptimizerError, match="with amsgrad keeps a third moment"):
        ct.moments(m, torch.optim.Adam(m.parameters(), amsgrad=True))
    with pytest.raises(UnsupportedOptimizerError, match="Adagrad keeps state .* supported: Adam, AdamW"):
        ct.moments(m, torch.optim.Adagrad(m.parameters(), lr=0.1))


def test_content_hash_is_checked_on_load(tmp_path):
    m, opt = model_and_opt()
    train(m, opt, 1)
    r = ct.save(str(tmp_path / "step_000001.bin"), m, opt)
    data = bytearray(open(r.path, "rb").read())
    data[12] ^= 1
    open(r.path, "wb").write(bytes(data))
    with pytest.raises(ckptfmt.errors.FingerprintMismatchError):
        ct.load(r.path, *model_and_opt())


def test_rng_state_round_trips_through_json(tmp_path):
    import json
    import random
    import numpy as np
    gen = np.random.default_rng(3)
    random.seed(4)
    torch.manual_seed(5)
    state = json.loads(json.dumps(ct.rng_state({"g": gen})))
    want = (random.random(), gen.random(), torch.rand(1).item())
    random.seed(0)
    torch.manual_seed(0)
    gen2 = np.random.default_rng(0)
    ct.restore_rng(state, {"g": gen2})
    assert (random.random(), gen2.random(), torch.rand(1).item()) == want
    with pytest.raises(IncompleteResumeStateError, match="rng.torch_cpu"):
        ct.restore_rng({k: v for k, v in state.items() if k != "torch_cpu"}, {"g": gen2})


def test_loading_into_an_optimizer_with_state_copies_in_place_and_continues_bit_exactly(tmp_path):
    m, opt = model_and_opt()
    train(m, opt, 3)
    r = ct.save(str(tmp_path / "step_000003.bin"), m, opt)
    m2, opt2 = model_and_opt(seed=7)
    train(m2, opt2, 5, seed=9)                        # a live optimizer with other state
    before = [opt2.state[p]["exp_avg"].data_ptr() for p in m2.parameters()]
    opt2.param_groups[0]["lr"] = 0.5
    ct.load(r.path, m2, opt2)
    assert [opt2.state[p]["exp_avg"].data_ptr() for p in m2.parameters()] == before     # no new tensors
    assert opt2.param_groups[0]["lr"] == 0.01 and int(opt2.state[next(m2.parameters())]["step"]) == 3
    train(m, opt, 4, seed=2)
    train(m2, opt2, 4, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    assert all(torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"])
               for a, b in zip(m.parameters(), m2.parameters()))


def test_shape_mismatch_is_refused_before_any_value_is_copied(tmp_path):
    m, opt = model_and_opt()
    train(m, opt, 1)
    r = ct.save(str(tmp_path / "step_000001.bin"), m, opt)
    torch.manual_seed(3)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match=r"2\.weight: shape \[2, 8\] in the file, \[3, 8\] in the model"):
        ct.load(r.path, other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_hash_mismatch_names_both_digests_and_leaves_the_model_untouched(tmp_path):
    m, opt = model_and_opt()
    train(m, opt, 2)
    r = ct.save(str(tmp_path / "step_000002.bin"), m, opt)
    data = bytearray(open(r.path, "rb").read())
    data[-1] ^= 0x40                                 # the last byte of v
    open(r.path, "wb").write(bytes(data))
    m2, opt2 = model_and_opt(seed=4)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(ckptfmt.errors.FingerprintMismatchError) as info:
        ct.load(r.path, m2, opt2)
    assert str(info.value).startswith(f"{r.path}: blake3 mismatch: manifest says {r.blake3}")
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters())) and not opt2.state
    ct.load(r.path, m2, opt2, verify=False)          # opt-out: the damaged byte is loaded as it is
    assert opt2.state[list(m2.parameters())[-1]]["exp_avg_sq"].view(-1)[-1].item() != \
        opt.state[list(m.parameters())[-1]]["exp_avg_sq"].view(-1)[-1].item()


def _mapped_rss_kb(path: str) -> int:
    """Resident kB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = fields[-1] == path
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_load_releases_the_mapped_file_as_it_copies(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(1024, 1024)                  # 12.6 MB file
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 1024)).sum().backward()
    opt.step()
    r = ct.save(str(tmp_path / "step_000001.bin"), m, opt)
    m2 = torch.nn.Linear(1024, 1024)
    opt2 = torch.optim.AdamW(m2.parameters())
    for verify in (False, True):
        ck = ct.load(r.path, m2, opt2, verify=verify)
        assert _mapped_rss_kb(r.path) < 1024, verify   # < 1 MB of 12.6 MB still resident
        ck.close()
        assert torch.equal(m2.weight, m.weight)
        assert torch.equal(opt2.state[m2.weight]["exp_avg_sq"], opt.state[m.weight]["exp_avg_sq"])


READ_ONLY_ALIAS = r"""
import sys, warnings
import torch, ckptfmt, ckptfmt.torch as ct
from ckptfmt.torch.adapter import _view
path = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(m.parameters(), lr=0.01)
ck = ckptfmt.open(path)                       # read-only: the default
assert not ck.m.flags.writeable
with warnings.catch_warnings():
    warnings.simplefilter("error")            # torch warns when handed a read-only array
    views = [_view(ck.m, e) for e in ck.layout]
    ct.load(ck, m, opt)
for t in views:
    t.add_(1.0)                               # would kill the process through a PROT_READ alias
for state in opt.state.values():
    state["exp_avg"].add_(1.0)
opt.zero_grad(); m(torch.randn(3, 4)).sum().backward(); opt.step()
print("ok")
"""


def test_views_of_a_read_only_map_are_never_writable_aliases(tmp_path):
    """Given a Checkpoint opened read-only, the adapter hands out copies, not writable aliases
    of pages mapped PROT_READ: writing through them, and stepping the optimizer, neither crashes
    (SIGSEGV, in a subprocess here) nor changes the file."""
    import subprocess
    import sys
    m, opt = model_and_opt()
    train(m, opt, 2)
    r = ct.save(str(tmp_path / "step_000002.bin"), m, opt)
    before = open(r.path, "rb").read()
    proc = subprocess.run([sys.executable, "-c", READ_ONLY_ALIAS, r.path], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
    assert open(r.path, "rb").read() == before
    ckptfmt.open(r.path, verify=True).close()


def test_a_large_tensor_is_loaded_in_slices_with_its_pages_released_between_them(tmp_path, monkeypatch):
    """A tensor larger than ``SLICE`` is copied slice by slice (so a 256 MB embedding does not
    map 256 MB at once: benchmarks/README.md "Scale"), and every value still arrives."""
    from ckptfmt import reader
    from ckptfmt.torch import adapter
    monkeypatch.setattr(adapter, "SLICE", 100)
    torch.manual_seed(0)
    model = torch.nn.Linear(30, 33)                       # 990 + 33 elements: 10 slices + 1
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    path = str(tmp_path / "step_000001.bin")
    ct.save(path, model, opt)
    released = []
    real = reader.Checkpoint.release
    monkeypatch.setattr(reader.Checkpoint, "release", lambda self, o, n: (released.append(n), real(self, o, n)))
    monkeypatch.setattr(reader.ReleaseBehind, "BATCH", 1)
    other = torch.nn.Linear(30, 33)
    other_opt = torch.optim.AdamW(other.parameters())
    ct.load(path, other, other_opt).close()
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], other_opt.state[b]["exp_avg_sq"])
    assert len(released) >= 3 * 11          # at least one release per slice of each region
    assert list(adapter._copy_in_slices(torch.empty(250), torch.ones(250))) == [100, 200, 250]
