"""A generation written through a store, the same calls on a local directory and on an
S3-protocol server (moto's, on 127.0.0.1): each part streamed and hashed as written, the
manifest last and only once every part reads back as written; an exclusive create (S3's
conditional PUT), and on it the run's writer lease: one holder, renewed, taken over only once
expired, and a taken-over holder told at its next renew."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ckptfmt import fingerprint, generation, writer
from ckptfmt import format as fmt
from ckptfmt.errors import FingerprintMismatchError, RunLockedError, SaveError
from ckptfmt.run import Policy
from ckptfmt.run.storelock import StoreLock, StoreReadLease, leased
from ckptfmt.tools import restore as restore_module
from ckptfmt.run.mirror import mirror
from ckptfmt.store import commit
from ckptfmt.store.local import LocalStore
from conftest import make
from s3server import fixtures

pytest.importorskip("s3fs")
from ckptfmt.store.objects import ObjectStore  # noqa: E402

s3, bucket = fixtures("writes")


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        (tmp_path / "run").mkdir()
        return LocalStore(tmp_path / "run")
    return ObjectStore(f"s3://{request.getfixturevalue('bucket')}/runs/a")


def a_generation(tmp_path, step=7):
    """A committed .bin generation's files (bytes by name) as the writer makes them."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    writer.save(src / fmt.checkpoint_name(step), step, np.arange(50, dtype="<f4"), np.ones(50, "<f4"),
                np.zeros(50, "<f4"))
    return {name: (src / name).read_bytes() for name in (fmt.checkpoint_name(step), fmt.manifest_name(step))}


def in_chunks(data: bytes, size: int = 64):
    return (data[i:i + size] for i in range(0, len(data), size))


def test_a_generation_written_part_by_part_is_committed_by_its_manifest_last(store, tmp_path):
    files = a_generation(tmp_path)
    payload = fmt.checkpoint_name(7)
    done = store.write(payload, in_chunks(files[payload]))
    assert (done.name, done.size, done.blake3) == (payload, len(files[payload]), fingerprint.of_bytes(files[payload]))
    gen = generation.by_step(store)[7]
    assert not gen.committed and gen.leftover() is not None          # parts without a manifest: uncommitted
    commit(store, fmt.manifest_name(7), files[fmt.manifest_name(7)], [done])
    gen = generation.by_step(store)[7]
    assert gen.committed and gen.check(deep=True) is None


def test_a_part_that_is_not_what_was_written_is_never_committed(store, tmp_path):
    files = a_generation(tmp_path)
    payload = fmt.checkpoint_name(7)
    done = store.write(payload, [files[payload]])
    damaged = bytearray(files[payload])
    damaged[-1] ^= 0x01                                              # same size: only the read-back digest sees it
    store.put_bytes(payload, bytes(damaged))
    with pytest.raises(SaveError, match=f"{payload}: on the store it hashes to .*; not committed"):
        commit(store, fmt.manifest_name(7), files[fmt.manifest_name(7)], [done])
    assert store.size(fmt.manifest_name(7)) is None
    store.put_bytes(payload, files[payload][:-4])
    with pytest.raises(SaveError, match=f"{len(files[payload]) - 4} bytes, {len(files[payload])} were written"):
        commit(store, fmt.manifest_name(7), files[fmt.manifest_name(7)], [done])


def test_a_part_whose_bytes_are_not_the_expected_ones_is_never_published(store, tmp_path):
    files = a_generation(tmp_path)
    payload = fmt.checkpoint_name(7)
    with pytest.raises(FingerprintMismatchError, match="not (written|uploaded)"):
        store.write(payload, in_chunks(files[payload]), expected="0" * 64)
    assert store.size(payload) is None


def test_an_exclusive_create_is_made_once_and_never_replaced(store):
    assert store.create(".writer", b"pid 1") is True
    assert store.create(".writer", b"pid 2") is False
    assert store.read_bytes(".writer") == b"pid 1"


class Clock:
    """A wall clock the test moves (every writer sharing the store reads the same time)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_one_writer_holds_the_lease_until_it_expires_and_a_taken_over_holder_learns_it_at_its_renew(store):
    clock = Clock()
    first = StoreLock(store, purpose="trainer", ttl_s=60, clock=clock).acquire()
    with pytest.raises(RunLockedError, match=f"held by trainer pid {os.getpid()} on "):
        StoreLock(store, purpose="second", ttl_s=60, clock=clock).acquire()
    clock.now += 50
    first.renew()                                        # the heartbeat: 60 s more from now
    clock.now += 50
    with pytest.raises(RunLockedError):
        StoreLock(store, purpose="second", ttl_s=60, clock=clock).acquire()
    clock.now += 11                                      # 61 s since the renew: expired
    second = StoreLock(store, purpose="second", ttl_s=60, clock=clock).acquire()
    with pytest.raises(RunLockedError, match="taken over by second pid"):
        first.renew()                                    # the stalled holder stops before it writes more
    first.release()                                      # leaves the new holder's lease alone
    with pytest.raises(RunLockedError, match="held by second"):
        StoreLock(store, purpose="third", ttl_s=60, clock=clock).acquire()
    second.release()
    StoreLock(store, purpose="third", ttl_s=60, clock=clock).acquire()


def test_of_writers_racing_for_an_expired_lease_exactly_one_gets_it(store):
    clock = Clock()
    StoreLock(store, ttl_s=60, clock=clock).acquire()
    clock.now += 61
    start, won, refused = threading.Barrier(6), [], []

    def race(i):
        lock = StoreLock(store, purpose=f"racer{i}", ttl_s=60, clock=clock)
        start.wait()
        try:
            won.append(lock.acquire())
        except RunLockedError:
            refused.append(i)
    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(refused) == 5


def test_a_readers_lease_at_a_mirror_keeps_its_steps_from_the_retention_there_until_it_ends(s3, bucket, tmp_path):
    run, url = tmp_path / "run", f"s3://{bucket}/leased"
    run.mkdir()
    for step in (10, 20, 30):
        make(run, step)
    mirror(run, url)                                               # every generation at the destination
    remote = ObjectStore(url)
    with StoreReadLease(remote, [10], purpose="import", ttl_s=3600) as claim:
        assert claim.problem is None and leased(remote) == {10}
        mirror(run, url, retention=Policy(keep_last=1))
        assert sorted(s for s, g in generation.by_step(remote).items() if g.committed) == [10, 30]
        assert leased(remote, lambda: time.time() + 3601) == set()  # an expired claim holds nothing
    assert leased(remote) == set() and not [e for e in remote.entries() if e.name.startswith(".lease.")]
    mirror(run, url, retention=Policy(keep_last=1))
    assert sorted(s for s, g in generation.by_step(remote).items() if g.committed) == [30]


def test_an_import_from_a_mirror_holds_a_read_lease_while_it_reads(s3, bucket, tmp_path, monkeypatch):
    run, url = tmp_path / "run", f"s3://{bucket}/importing"
    run.mkdir()
    make(run, 10)
    mirror(run, url)
    seen = []
    first_valid = restore_module._first_valid

    def looking(remote, *args, **kwargs):                         # what a retention there would see now
        seen.append(leased(remote))
        return first_valid(remote, *args, **kwargs)
    monkeypatch.setattr(restore_module, "_first_valid", looking)
    restore_module.restore(url, tmp_path / "back")
    assert seen == [{10}] and leased(ObjectStore(url)) == set()


def test_a_lease_of_a_dead_process_here_is_taken_over_at_once_and_only_in_its_pid_namespace(tmp_path):
    """A restart after a kill on the same machine need not wait the lease out; a holder in
    another pid namespace (another container with the same host name) is never taken for dead."""
    import json
    import socket
    import subprocess
    from ckptfmt.run.storelock import _boot, _pid_namespace
    store = LocalStore(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()                                       # a pid that no longer exists
    for pidns, taken in ((_pid_namespace() + 1, False), (_pid_namespace(), True)):
        for entry in store.entries():
            store.remove(entry.name)
        store.put_bytes(".writer.0000000001", json.dumps({
            "pid": gone.pid, "host": socket.gethostname(), "pidns": pidns, "boot": _boot(), "purpose": "trainer",
            "expires": time.time() + 3600}).encode())
        if taken:
            lock = StoreLock(store, purpose="trainer").acquire()
            assert lock.number == 2 and [e.name for e in store.entries()] == [".writer.0000000002"]
            lock.release()
        else:
            with pytest.raises(RunLockedError, match="held by trainer pid"):
                StoreLock(store, purpose="trainer").acquire()


def test_a_holder_whose_lease_number_was_taken_again_after_a_takeover_learns_it(tmp_path):
    """A holder stalls past its expiry; another takes the lease over (number 2, the older object
    removed) and releases it; a third acquires on an empty store and gets number 1 again. The
    stalled holder's renew tells it by its token, never renewing the third's lease as its own."""
    now = [1000.0]
    store = LocalStore(tmp_path)
    stalled = StoreLock(store, purpose="trainer", ttl_s=1, clock=lambda: now[0]).acquire()
    now[0] += 5
    StoreLock(store, purpose="gc", ttl_s=1, clock=lambda: now[0]).acquire().release()
    third = StoreLock(store, purpose="trainer", ttl_s=1, clock=lambda: now[0]).acquire()
    assert third.number == stalled.number == 1
    with pytest.raises(RunLockedError, match="taken over"):
        stalled.renew()
    third.renew()


def test_an_error_naming_an_endpoint_port_with_403_in_it_is_not_called_access_denied():
    from ckptfmt.store.objects import _reason
    timeout = TimeoutError('Read timeout on endpoint URL: "http://127.0.0.1:40312/bkt/runs/x/step_000008.bin"')
    assert "access denied" not in _reason(timeout)
    assert _reason(PermissionError("An error occurred (403) when calling the PutObject operation: Forbidden")) == \
        "access denied"


def test_the_heartbeat_renews_the_lease_and_tells_the_writer_when_it_is_lost(tmp_path):
    """Renewed every third of its TTL on its own thread; a newer lease (a takeover) or a store
    that could not be written for a whole TTL is kept and raised by the writer's next check."""
    import shutil
    from ckptfmt.run.storelock import Heartbeat
    import json
    store = LocalStore(tmp_path)
    beat = Heartbeat(StoreLock(store, purpose="trainer", ttl_s=0.6).acquire())
    try:
        first = json.loads(store.read_bytes(".writer.0000000001"))["expires"]
        time.sleep(0.5)
        assert json.loads(store.read_bytes(".writer.0000000001"))["expires"] > first      # renewed
        beat.check()
        store.put_bytes(".writer.0000000002", json.dumps({"purpose": "gc", "pid": 1, "host": "h",
                                                          "expires": time.time() + 60}).encode())
        with pytest.raises(RunLockedError, match="taken over by gc"):
            beat.check()
    finally:
        beat.release()
    # a store that can be neither read nor written for longer than the TTL (its directory gone,
    # a file in its place)
    (tmp_path / "other").mkdir()
    store = LocalStore(tmp_path / "other")
    beat = Heartbeat(StoreLock(store, purpose="trainer", ttl_s=0.3).acquire())
    try:
        shutil.rmtree(tmp_path / "other")
        (tmp_path / "other").write_bytes(b"not a directory")
        time.sleep(0.8)
        with pytest.raises(RunLockedError, match="could not be renewed"):
            beat.check()
    finally:
        beat._stop.set()


def requests_sent(store: ObjectStore) -> list[tuple[str, str, bool]]:
    """(method, URL, whether it carries an upload checksum) of every request the store's client
    sends from now on (botocore's ``before-send`` event: what went over the wire, retries included)."""
    sent: list[tuple[str, str, bool]] = []
    store.exists("x")                                 # the client is made at its first call
    store.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        (request.method, request.url, any(k.lower().startswith("x-amz-checksum-") for k in request.headers))))
    return sent


@pytest.mark.parametrize("size", [100, 2 * (16 << 20) + 5])
def test_on_s3_a_part_is_confirmed_by_the_etag_the_store_computed_not_read_back(s3, bucket, size):
    """S3's ETag is the MD5 of each part it received and then of those MD5s: the upload cuts its
    own parts, checks each part's ETag against what it sent, and the commit confirms the object
    by one HEAD, with no GET of its bytes. Each part carries the client's checksum as well (which
    S3 checks on receipt; moto's server does not)."""
    import hashlib
    store = ObjectStore(f"s3://{bucket}/runs/etag{size}")
    data = np.random.default_rng(size).bytes(size)
    uploads = requests_sent(store)
    done = store.write("step_000007.bin", in_chunks(data, 3 << 20))
    assert [checked for method, _, checked in uploads if method == "PUT"] == [True] * -(-size // (16 << 20))
    md5 = [hashlib.md5(data[i:i + (16 << 20)]).digest() for i in range(0, size, 16 << 20)]
    expected = md5[0].hex() if size < 16 << 20 else f"{hashlib.md5(b''.join(md5)).hexdigest()}-{len(md5)}"
    assert done.checksum == expected == store.checksum("step_000007.bin")
    sent = requests_sent(store)
    commit(store, "step_000007.json", b"{}", [done])
    assert [m for m, url, _ in sent if m == "GET" and "step_000007.bin" in url] == []
    assert [m for m, url, _ in sent if "step_000007" in url] == ["HEAD", "PUT"]   # size and ETag, manifest
    assert s3.client().get_object(Bucket=bucket, Key=f"runs/etag{size}/step_000007.bin")["Body"].read() == data


def etags(s3, bucket: str, prefix: str) -> dict[str, str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: o["ETag"] for o in listed}


def test_a_stalled_writer_never_replaces_or_removes_a_generation_the_new_holder_committed(s3, bucket):
    """A writer whose lease was taken over while it stalled (SIGSTOP, a suspended VM) and that
    then saves the step the new holder has committed meanwhile: it listed that step as absent
    before its stall, so what stops it is the store. Parts and manifests are written
    create-only (``If-None-Match: *`` on the PutObject and on a multipart upload's completion),
    so its first part is refused (step 8, a .bin of two parts); and where the new holder's save
    happens in the stall just before its manifest, having removed the stalled one's parts as
    leftovers (step 12, one PutObject each), the manifest is refused and the failed save's
    cleanup, removing only what it wrote itself, leaves the new holder's generation alone.
    Either way the old writer fails, and the new holder's objects stay as they were and verify."""
    from ckptfmt.store import writing
    from ckptfmt.tools.remote_check import validate_url
    url, prefix = f"s3://{bucket}/runs/stalled", "runs/stalled/"

    def regions(n, value):
        return np.full(n, value, "<f4"), np.zeros(n, "<f4"), np.zeros(n, "<f4")
    store, big = ObjectStore(url), (16 << 20) // 12 + 1024
    writing.save(store, 8, *regions(big, 2))       # the new holder committed step 8
    there = etags(s3, bucket, prefix)
    with pytest.raises(SaveError, match="on the store already"):
        writing.save(store, 8, *regions(big, 1))
    assert etags(s3, bucket, prefix) == there

    def new_holder_saves(doc):                     # in the stall before the manifest: sweep, save, commit
        generation.by_step(store)[12].remove()
        writing.save(store, 12, *regions(50, 2))
        there.update(etags(s3, bucket, prefix))
    with pytest.raises(SaveError, match="another writer's"):
        writing.save(store, 12, *regions(50, 1), before_commit=new_holder_saves)
    assert etags(s3, bucket, prefix) == there and fmt.manifest_name(12) in there
    done = validate_url(url)
    assert done["ok"] and [(g["step"], g["status"]) for g in done["generations"]] == [(8, "verified"), (12, "verified")]
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")


def test_on_s3_an_upload_left_unfinished_publishes_nothing_and_leaves_no_parts(s3, bucket):
    store = ObjectStore(f"s3://{bucket}/runs/unfinished")
    with pytest.raises(RuntimeError, match="the writer failed"):
        with store.open_part("step_000007.bin") as out:
            out.write(b"\1" * ((16 << 20) + 1))                       # one part went up
            raise RuntimeError("the writer failed")
    assert store.size("step_000007.bin") is None
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix="runs/unfinished/").get("Uploads")


def test_on_a_store_that_ignores_if_none_match_a_second_writer_is_refused_and_an_overwritten_holder_learns_it(
        s3, bucket, monkeypatch):
    """Some S3-compatible servers ignore ``If-None-Match: *``: a create there replaces what is
    there. The lease still refuses a writer that comes while another's is live (it lists the
    leases first); only two writers creating the same lease in the same instant both succeed,
    and the one overwritten learns it at its next check (it reads its own lease back)."""
    from s3server import UnconditionalProxy
    from ckptfmt.run.storelock import _name, created
    with UnconditionalProxy(s3.port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = ObjectStore(f"s3://{bucket}/runs/unconditional")
        assert store.create(".probe", b"one") is True
        assert store.create(".probe", b"two") is True                   # the condition was ignored
        assert store.read_bytes(".probe") == b"two"
        holder = StoreLock(store, purpose="trainer").acquire()
        with pytest.raises(RunLockedError, match="held by trainer pid"):
            StoreLock(ObjectStore(f"s3://{bucket}/runs/unconditional"), purpose="trainer").acquire()
        assert created(store, _name(holder.number), b'{"purpose": "racer"}')   # the same instant's create
        with pytest.raises(RunLockedError, match="taken over"):
            holder.renew()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    direct = ObjectStore(f"s3://{bucket}/runs/direct")                  # the server itself honours it
    assert direct.create(".probe", b"one") is True and direct.create(".probe", b"two") is False


def test_a_writer_waits_out_a_lease_no_longer_renewed_and_is_refused_by_one_renewed(tmp_path):
    """A restart on a fresh container cannot see whether a holder on another machine is gone: it
    waits while the lease is not renewed and takes it once expired; a renewal seen meanwhile is a
    live writer's, refused; a holder alive on this machine is refused at once."""
    import json
    from ckptfmt.run.storelock import _name

    store = LocalStore(tmp_path)

    def elsewhere(lock: StoreLock, ttl_s: float = 1.2) -> None:
        """The lease of ``lock`` as a holder on another machine writes it."""
        doc = json.loads(store.read_bytes(_name(lock.number)))
        store.put_bytes(_name(lock.number), json.dumps({**doc, "host": "another-machine",
                                                        "expires": time.time() + ttl_s}).encode())
    stopped = StoreLock(store, purpose="trainer", ttl_s=1.2).acquire()
    elsewhere(stopped)                                                     # then never renewed again
    began = time.monotonic()
    with pytest.warns(UserWarning, match="not renewed from where it can be seen.*waiting for it to run out"):
        taker = StoreLock(store, purpose="trainer", ttl_s=1.2).acquire(wait=True)
    assert time.monotonic() - began >= 1.0 and taker.number == stopped.number + 1
    with pytest.raises(RunLockedError, match="taken over"):
        stopped.renew()
    elsewhere(taker)
    renewing, done = threading.Event(), threading.Event()

    def renew_elsewhere() -> None:
        while not done.wait(0.3):
            elsewhere(taker)
            renewing.set()
    beat = threading.Thread(target=renew_elsewhere)
    beat.start()
    try:
        renewing.wait(5)
        with pytest.warns(UserWarning), pytest.raises(RunLockedError, match="held by trainer pid .* on another-machine"):
            StoreLock(store, purpose="trainer", ttl_s=1.2).acquire(wait=True)
        began = time.monotonic()
        with pytest.raises(RunLockedError, match="held by trainer pid"):   # gc and pivot do not wait
            StoreLock(store, purpose="gc").acquire()
        assert time.monotonic() - began < 0.5
    finally:
        done.set()
        beat.join()
    far = StoreLock(LocalStore(tmp_path), purpose="trainer", ttl_s=1.2)     # a clock far ahead: not waited out
    far.number = taker.number
    elsewhere(far, ttl_s=600)
    began = time.monotonic()
    with pytest.warns(UserWarning), pytest.raises(RunLockedError, match="held by trainer pid .* until 20"):
        StoreLock(store, purpose="trainer", ttl_s=0.6).acquire(wait=True)
    assert time.monotonic() - began < 2
    (tmp_path / "here").mkdir()
    here = StoreLock(LocalStore(tmp_path / "here"), purpose="trainer", ttl_s=60).acquire()
    began = time.monotonic()
    with pytest.raises(RunLockedError, match="held by trainer pid"):      # alive on this machine: at once
        StoreLock(here.store, purpose="trainer").acquire(wait=True)
    assert time.monotonic() - began < 0.5
