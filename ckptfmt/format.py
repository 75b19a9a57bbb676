"""Layout facts of ``step_NNNNNN.bin`` (spec/FORMAT.md §2-§3). No I/O lives here.

The seed fixes the layout byte for byte::

    [int32 step][int32 n_params][n x f32 weights][n x f32 m][n x f32 v]

little-endian, no magic, no version, no padding; a file is recognised by the size law
``size == 8 + 12 * n_params``.

>>> file_size(12_800_000)
153600008
>>> checkpoint_name(1_000_000)
'step_1000000.bin'
"""
from __future__ import annotations

import re
import struct

import numpy as np

HEADER = struct.Struct("<ii")            # spec §2: step, n_params as int32 LE
HEADER_SIZE = HEADER.size                # 8
DTYPE = np.dtype("<f4")                  # spec §2: every region is float32 LE
ITEM = DTYPE.itemsize                    # 4
MAX_N = 2**31 - 1                        # int32 upper bound for n_params
MAX_STEP = 2**31 - 1
REGIONS = ("weights", "m", "v")          # spec §2: region order in the file
MIN_DIGITS = 6                           # spec §3: step_ + at least 6 digits

_NAME = re.compile(r"^step_(\d{6,})\.(bin|json|shards|extra\.safetensors)$")


def file_size(n_params: int) -> int:
    """Size in bytes of a file holding ``n_params`` parameters (spec §2 size law)."""
    return HEADER_SIZE + 3 * ITEM * n_params


def region_offset(region: str, n_params: int) -> int:
    """Byte offset of ``region`` ('weights', 'm' or 'v') in a file of ``n_params``."""
    return HEADER_SIZE + REGIONS.index(region) * ITEM * n_params


def n_params_for_size(size: int) -> int | None:
    """The n_params a file of ``size`` bytes would hold, or None if the size law fails."""
    body = size - HEADER_SIZE
    if body < 0 or body % (3 * ITEM):
        return None
    return body // (3 * ITEM)


def pack_header(step: int, n_params: int) -> bytes:
    """The 8 header bytes; refuses values an int32 cannot hold or the spec forbids."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
    if not 0 <= n_params <= MAX_N:
        raise ValueError(f"n_params must be in 0..{MAX_N}, got {n_params}")
    return HEADER.pack(step, n_params)


def unpack_header(data: bytes) -> tuple[int, int]:
    """(step, n_params) as Python ints from the first 8 bytes."""
    step, n = HEADER.unpack(data[:HEADER_SIZE])
    return int(step), int(n)


def stem(step: int) -> str:
    """``step_`` + the step zero-padded to at least 6 digits, never truncated (spec §3)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:0{MIN_DIGITS}d}"


def checkpoint_name(step: int) -> str:
    return stem(step) + ".bin"


def manifest_name(step: int) -> str:
    return stem(step) + ".json"


def parse_name(name: str) -> tuple[int, str] | None:
    """(step, 'bin'|'json'|'shards'|'companion') for a canonical name; None for anything else.

    Only the canonical spelling counts: ``step_0000100.bin`` (an extra zero) is a look-alike,
    not generation 100, so two names can never claim the same step.
    """
    match = _NAME.match(name)
    if not match:
        return None
    step = int(match.group(1))
    if stem(step) != name.split(".", 1)[0] or step > MAX_STEP:
        return None
    kind = match.group(2)
    return step, "companion" if kind == "extra.safetensors" else kind


TEMP_PREFIX = ".ckptfmt-tmp."            # spec §5: never matches step_*.bin


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)
