"""The run directory layer (spec/RUN.md): everything about ``runs/NAME/`` above single files.

Generations and latest-valid (``Run``), the one-writer lock, the pure retention policy, the
loss history, the sidecars and their rules, read leases, and the operations on a whole run
(ls, pivot, fork, bisect). It imports only the core; torch never.
"""
from .directory import Run
from ..generation import Generation, Listing, list_dir
from .history import History
from .lease import LEASES, ReadLease, active_leases
from .lock import LOCK, RunLock, lock_holder, save_in_progress, writing_into
from .ops import bisect, fork, gc, ls_run, pivot
from .retention import Candidate, Policy, parse_duration, plan, plan_retention
from .saving import SaveClock, SavePolicy
from .sidecars import ARCHIVE, PINS, PIVOT, POLICY, SAMPLES, STATE, read_json, record_policy, recorded_policy, zombie_arms

__all__ = ["Run", "Generation", "Listing", "list_dir", "History", "LEASES",
           "ReadLease", "active_leases", "LOCK", "RunLock", "lock_holder", "save_in_progress", "writing_into",
           "bisect", "fork", "gc", "ls_run", "pivot", "plan_retention",
           "Candidate", "Policy", "parse_duration", "plan", "SaveClock", "SavePolicy",
           "ARCHIVE", "PINS", "PIVOT", "POLICY", "SAMPLES", "STATE", "read_json", "record_policy",
           "recorded_policy", "zombie_arms"]
