"""Which RAM generation every rank can reach across nodes (spec/RUN.md §13.9), on real sharded
generations: the pairing, a node's inventory, the choice, the fetch plan and a node's retention."""
import json
import shutil

import numpy as np
import pytest

import ckptfmt
from ckptfmt import manifest as mf
from ckptfmt import facts, shards
from ckptfmt.errors import ManifestError
from ckptfmt.run import Run, replicas, tiers

N = 1000


def generation(tier, step, world=2):
    """A committed sharded generation of ``step`` in ``tier`` (one .bin split in ``world`` shards)."""
    src = tier.parent / f"src-{tier.name}-{step}" / f"step_{step:06d}.bin"
    src.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(step)
    w, m, v = (rng.standard_normal(N).astype("<f4") for _ in range(3))
    ckptfmt.save(src, step, w, m, abs(v))
    shards.split(src, tier, world)
    return tier


def two_nodes(tmp_path, steps=(65, 70)):
    """Two nodes' tiers holding the same generations (each shard and its partner's copy)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for step in steps:
        generation(a, step)
    shutil.copytree(a, b)
    return a, b


def shard(tier, step, k=0, world=2):
    return tier / f"step_{step:06d}.shards" / f"{k:05d}-of-{world:05d}.bin"


def flip(path, at=100):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_partners_are_the_same_local_rank_on_the_next_node_and_pair_every_rank_once():
    for local, world in ((1, 2), (2, 4), (2, 6), (4, 12)):
        to = [replicas.partner(r, local, world) for r in range(world)]
        assert sorted(to) == list(range(world))                              # a permutation
        assert all(t // local != r // local and t % local == r % local for r, t in enumerate(to))
        assert [replicas.sender(t, local, world) for t in to] == list(range(world))


def test_an_inventory_hashes_what_the_manifest_names(tmp_path):
    a, _ = two_nodes(tmp_path)
    inv = replicas.inventory(a)
    assert sorted(inv) == ["65", "70"]
    doc = json.loads((a / "step_000070.json").read_text())
    assert inv["70"]["manifest"] == doc
    assert {name: d for name, (_, d) in replicas.files_of(doc).items()} == inv["70"]["digests"]
    assert replicas.inventory(tmp_path / "absent") == {} and replicas.inventory(None) == {}


def test_the_newest_step_every_file_of_which_some_node_holds_is_chosen(tmp_path):
    a, b = two_nodes(tmp_path)
    shard(b, 70, 1).unlink()                      # node b lost shard 1 of 70: node a still has it
    reach = replicas.reachable([replicas.inventory(a), replicas.inventory(b)], newer_than=50)
    assert reach.step == 70 and reach.skipped == []
    assert replicas.transfers(reach, 2) == [("step_000070.shards/00001-of-00002.bin", 0, 1)]
    fresh = replicas.reachable([replicas.inventory(a), {}], newer_than=None)   # a replacement node
    assert fresh.step == 70 and len(replicas.transfers(fresh, 2)) == 2


def test_a_shard_damaged_on_every_node_passes_the_step_over_with_its_reason(tmp_path):
    a, b = two_nodes(tmp_path)
    flip(shard(a, 70))
    flip(shard(b, 70))
    reach = replicas.reachable([replicas.inventory(a), replicas.inventory(b)], newer_than=None)
    assert reach.step == 65
    assert reach.skipped == [(70, "step_000070.shards/00000-of-00002.bin fails blake3 on every node that holds it")]
    flip(shard(a, 70))                             # one good copy again: it is fetched for b
    reach = replicas.reachable([replicas.inventory(a), replicas.inventory(b)], newer_than=None)
    assert reach.step == 70 and replicas.transfers(reach, 2) == [("step_000070.shards/00000-of-00002.bin", 0, 1)]


def test_lost_shards_a_missing_manifest_and_different_manifests_are_said(tmp_path):
    a, b = two_nodes(tmp_path)
    for tier in (a, b):
        shard(tier, 70, 1).unlink()
        (tier / "step_000065.json").unlink()
    reach = replicas.reachable([replicas.inventory(a), replicas.inventory(b)], newer_than=None)
    assert reach.step is None
    assert reach.skipped == [(70, "step_000070.shards/00001-of-00002.bin is on no node"),
                             (65, "no node holds its manifest (a save interrupted before its commit)")]
    inv_a, inv_b = two_nodes(tmp_path / "x")
    other = json.loads((inv_b / "step_000070.json").read_text())
    other["note"] = "written by another rank"
    mf.write(inv_b / "step_000070.json", other)
    reach = replicas.reachable([replicas.inventory(inv_a), replicas.inventory(inv_b)], newer_than=None)
    assert (reach.step, reach.skipped) == (65, [(70, "the nodes' manifests of it differ")])


def test_the_durable_choice_wins_at_the_same_step_and_diverged_ones_are_passed_over(tmp_path):
    a, b = two_nodes(tmp_path)
    nodes = [replicas.inventory(a), replicas.inventory(b)]
    assert replicas.reachable(nodes, newer_than=70).step is None
    for inv in nodes:
        inv["70"]["manifest"][facts.FIELD]["m"].update(non_finite=3, finite=False)
    reach = replicas.reachable(nodes, newer_than=None)
    assert reach.step == 65 and reach.skipped[0][0] == 70 and reach.skipped[0][1].startswith("diverged: ")
    assert replicas.reachable(nodes, newer_than=None, allow_nonfinite=True).step == 70


def test_a_manifest_whose_shard_list_does_not_add_up_is_refused(tmp_path):
    a, _ = two_nodes(tmp_path)
    doc = json.loads((a / "step_000070.json").read_text())
    doc["shards"][1]["start"] += 1
    with pytest.raises(ManifestError):
        replicas.files_of(doc)
    nodes = [{"70": {"manifest": doc, "digests": {}}}]
    assert replicas.reachable(nodes, None).skipped[0][1].startswith("its manifest is damaged: ")


def test_a_nodes_tier_keeps_its_newest_two_committed_steps(tmp_path):
    tier = tmp_path / "a"
    for step in (55, 60, 65, 70):
        generation(tier, step)
    partial = tier / "step_000075.shards"
    partial.mkdir()
    (partial / "00000-of-00002.bin").write_bytes(b"x")      # a save interrupted before its commit
    assert tiers.prune(tier, 2) == [55, 60]
    assert sorted(p.name for p in tier.iterdir()) == ["step_000065.json", "step_000065.shards",
                                                      "step_000070.json", "step_000070.shards",
                                                      "step_000075.shards"]


def test_a_ram_generation_of_a_lost_timeline_is_passed_over(tmp_path):
    """A node away when the run went back to step 50 brings 70 of the old timeline; 65, saved
    since (its blake3 in the history), is this timeline's."""
    a, b = two_nodes(tmp_path)
    digest = {s: json.loads((a / f"step_{s:06d}.json").read_text())["blake3"] for s in (65, 70)}
    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "start", "step": 0}, {"event": "checkpoint", "step": 70, "tier": "memory", "blake3": digest[70]},
              {"event": "resume", "step": 50, "tier": "disk"},
              {"event": "checkpoint", "step": 65, "tier": "memory", "blake3": digest[65]}]
    (run / ".loss.json").write_text("".join(json.dumps({**e, "time": 1.0}) + "\n" for e in events))
    line = replicas.timeline(Run(run))
    assert line == {"since": 50, "saved": {"65": digest[65]}}
    reach = replicas.reachable([replicas.inventory(a), replicas.inventory(b)], None, timeline=line)
    assert reach.step == 65
    assert reach.skipped == [(70, "a lost timeline's: the run went back to step 50 and has not saved this one since")]
    assert replicas.inventory(a, above=65).keys() == {"70"}
