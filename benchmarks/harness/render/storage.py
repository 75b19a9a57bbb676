"""Object storage: the mirror against a plain upload, the trainer's stall with a mirror, runs
written straight to S3."""
from __future__ import annotations

from typing import Any, Callable

from .md import mb, table

SAVES = ("fsspec stream (no hash)", "fsspec pipe_file (no hash)", "ckptfmt save", "ckptfmt save, no confirmation",
         "DCP save")
RESTORES = ("fsspec cat_file (no hash)", "fsspec cat_file + blake3", "ckptfmt restore's read: latest() + open_at()",
            "ckptfmt store.digest (a read-back)")
MODES = ("async_save=False", "async_save=True")
STORE = "store_bench"


def mirror(results: Any) -> str:
    d = results.doc("mirror")
    rows = [["boto3 `upload_file` (multipart, 10 threads, no hash)", f"{d['upload_file_s']:.2f}", f"{d['upload_file_mbps']:.0f}"],
            ["`ckptfmt mirror`", f"{d['mirror_s']:.2f}", f"{d['mirror_mbps']:.0f}"],
            ["mirror / upload_file (time)", f"{d['mirror_over_upload_file']:.2f}x", ""],
            ["of the mirror: the streamed upload, hashed while sent", f"{d['of_which_streamed_upload_s']:.3f}", ""],
            ["of the mirror: the object's confirmation at the destination", f"{d['of_which_confirm_s']:.3f}", ""],
            ["reading the object back instead of the confirmation", f"{d['read_back_instead_s']:.3f}", ""]]
    return (table([f"one generation ({d['bytes']:,} bytes), {d['server']}", f"s, median of {d['reps']}", "MB/s"], rows)
            + "\n\n" + results.source("mirror"))


def mirror_stall(results: Any) -> str:
    rows = [[name.replace("--mirror", "`--mirror`"), str(r["checkpoints"]),
             f"{r['stall_ms_median']:.2f} ms ({r['stall_ms_min']:.2f}-{r['stall_ms_max']:.2f})", f"{r['wall_s_median']:.2f} s"]
            for name, r in results.doc("mirror_stall")["results"].items()]
    return (table(["run", "checkpoints", "stall per checkpoint, median (min-max)", "wall, median"], rows) + "\n\n"
            + results.source("mirror_stall"))


def _secs(e: dict[str, Any]) -> str:
    return f"{e['median']:.2f} s ({e['min']:.2f})"


def _ms(e: dict[str, Any]) -> str:
    return f"{e['median'] * 1e3:,.0f} ms ({e['min'] * 1e3:,.0f})"


def _requests(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} {c}" for op, c in sorted(counts.items()))


def _save_rows(s0: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (f"save: {n}", lambda s, n=n: f"{_secs(s['save'][n])}, {s['save'][n]['gbps_median']:.3f} "
                                      f"({s['save'][n]['gbps_best']:.3f}) GB/s") for n in SAVES]
    rows.append(("save: of which confirmation (ckptfmt save)", lambda s: f"{_secs(s['save']['confirmation']['confirm_s'])}, "
                 f"{s['save']['confirmation']['share_of_save_median'] * 100:.0f} % of the save"))
    rows += [(k.replace(" (throughput)", ""), lambda s, k=k: f"**{s['save']['ratios'][k]['median']:.2f}x** "
                                                             f"({s['save']['ratios'][k]['best']:.2f}x)") for k in s0["save"]["ratios"]]
    rows += [(f"HTTP requests per save: {n}", lambda s, n=n: f"{_requests(s['save'][n]['requests'])} (total "
                                                             f"{'/'.join(str(t) for t in s['save'][n]['requests_total'])})")
             for n in ("ckptfmt save", "ckptfmt save, no confirmation", "DCP save", "fsspec stream (no hash)")]
    return rows


def _restore_rows(s0: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    ours, theirs = RESTORES[2], RESTORES[0]
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (f"restore: {n}", lambda s, n=n: f"{_secs(s['restore'][n])}, {s['restore'][n]['gbps_median']:.3f} "
                                         f"({s['restore'][n]['gbps_best']:.3f}) GB/s") for n in RESTORES]
    rows.append(("restore: ckptfmt phases, open_run() / latest() (reads and hashes) / open_at() (medians)",
                 lambda s: " / ".join(f"{s['restore'][ours]['phases'][k]['median']:.2f} s"
                                      for k in ("open_run_s", "latest_s", "open_at_s"))))
    rows.append(("HTTP requests per restore: ckptfmt / cat_file",
                 lambda s: f"{sum(s['restore'][ours]['requests'].values())} ({_requests(s['restore'][ours]['requests'])}) / "
                           f"{sum(s['restore'][theirs]['requests'].values())}"))
    rows += [(k.replace(" (throughput)", ""), lambda s, k=k: f"**{s['restore']['ratios'][k]['median']:.2f}x** "
                                                             f"({s['restore']['ratios'][k]['best']:.2f}x)") for k in s0["restore"]["ratios"]]
    return rows


def _loop_rows() -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    sync, bg = MODES
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        (f"loop: step() on a save step, {m}", lambda s, m=m: f"{_ms(s['stall'][m]['save_step_s'])}; stall_s "
                                                            f"{s['stall'][m]['stall_s']['median'] * 1e3:,.0f} ms") for m in MODES]
    rows += [("loop: step() on a step without a save (sync / async)",
              lambda s: " / ".join(_ms(s["stall"][m]["plain_step_s"]) for m in MODES)),
             ("loop: an async save, from its step() to its commit (the loop trains meanwhile)",
              lambda s: _secs(s["stall"][bg]["committed_after_s"])),
             ("loop: HTTP requests inside one sync save step (all of them: save, history, lease, retention)",
              lambda s: "/".join(str(n) for n in s["stall"][sync]["requests_per_save_step"])),
             ("loop: a training step (16 tokens), alone / while an async save uploads",
              lambda s: f"{s['stall'][sync]['train_s']['median']:.2f} s / {s['stall'][bg]['train_during_save_s']['median']:.2f} s"),
             ("loop: async stall / sync stall", lambda s: f"{s['stall']['async_over_sync_stall']:.3f}x")]
    return rows


def _memory_rows() -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    def drop(s: dict[str, Any], n: str) -> str:
        return mb(s["save"][n]["memory"]["mem_available_before"] - s["save"][n]["memory"]["mem_available_min"])
    return [("server RSS idle / peak during a save (ckptfmt) / after delete, MB",
             lambda s: f"{mb(s['server_idle']['server_rss'])} / {mb(s['save']['ckptfmt save']['memory']['server_rss_peak'])} / "
                       f"{mb(s['save']['ckptfmt save']['memory']['server_rss_after_delete'])}"),
            ("server's open temp files, peak during a save (ckptfmt / DCP), MB",
             lambda s: f"{mb(s['save']['ckptfmt save']['memory']['server_files_peak'])} / "
                       f"{mb(s['save']['DCP save']['memory']['server_files_peak'])}"),
            ("MemAvailable drop during a save (ckptfmt / DCP / pipe_file), MB",
             lambda s: " / ".join(drop(s, n) for n in ("ckptfmt save", "DCP save", "fsspec pipe_file (no hash)")))]


def store(results: Any) -> str:
    """Median (min) per cell; ratios are throughput, ckptfmt's over the other's, by medians (by minima)."""
    doc = results.doc(STORE)
    labels = list(doc["sizes"])
    s0 = doc["sizes"][labels[0]]

    def cell(label: str, get: Callable[[dict[str, Any]], str]) -> str:
        try:
            return get(doc["sizes"][label])
        except (KeyError, TypeError, ValueError):
            return "-"
    rows = []
    for part in (_save_rows(s0) if "save" in s0 else [], _restore_rows(s0) if "restore" in s0 else [],
                 _loop_rows() if "stall" in s0 else [], _memory_rows() if "save" in s0 else []):
        rows += [[name, *(cell(k, get) for k in labels)] for name, get in part]
    heads = [f"{k} ({doc['sizes'][k]['bin_bytes'] / 1e9:.3f} GB .bin)" for k in labels]
    return table(["figure", *heads], rows) + "\n\n" + results.source(STORE)


BLOCKS = {"mirror": mirror, "mirror-stall": mirror_stall, "store": store}
