"""Deterministic kernels for a bit-exact resume, and the facts of what ran (manifest ``run``).

On CUDA (issue 20 item 3): cuBLAS gets a deterministic workspace (``CUBLAS_WORKSPACE_CONFIG``
forced to ``:4096:8`` unless it already names a deterministic one: a value set for speed would
make two runs differ), cuDNN is deterministic and not benchmarking, scaled-dot-product attention
is pinned to the math kernel (flash, memory-efficient and cuDNN attention have non-deterministic
backward passes) and ``torch.use_deterministic_algorithms(True)`` raises rather than warns. On
the CPU the kernels are deterministic already; warn-only stays, so an op without a deterministic
CPU twin cannot stop a run. What was set is returned for the manifest instead of a constant.
"""
from __future__ import annotations

import os
from typing import Any

import torch

DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def apply(device: torch.device) -> dict[str, Any]:
    """Set deterministic kernels for ``device``; the settings as the manifest records them."""
    if device.type == "cuda":
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_WORKSPACES:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_WORKSPACES[0]
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        pin_math_attention()
        torch.use_deterministic_algorithms(True)
    else:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return facts(device)


def pin_math_attention() -> None:
    """Only the math kernel for ``scaled_dot_product_attention`` (deterministic forward and backward)."""
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def facts(device: torch.device) -> dict[str, Any]:
    """What ran: deterministic mode, the attention kernel, and on CUDA the GPU and versions.

    >>> sorted(facts(torch.device("cpu")))
    ['deterministic', 'deterministic_mode', 'sdpa']
    """
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    out: dict[str, Any] = {"deterministic": torch.are_deterministic_algorithms_enabled(),
                           "deterministic_mode": "warn" if warn else "error",
                           "sdpa": "math" if device.type == "cpu" or _math_only() else "any"}
    if device.type == "cuda":
        out.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return out


def _math_only() -> bool:
    b = torch.backends.cuda
    return b.math_sdp_enabled() and not b.flash_sdp_enabled() and not b.mem_efficient_sdp_enabled() and \
        not (hasattr(b, "cudnn_sdp_enabled") and b.cudnn_sdp_enabled())
