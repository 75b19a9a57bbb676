"""What any PyTorch training loop may use: ``import ckptfmt.torch as ct``.

``ct.save`` / ``ct.load`` move a model's parameters and Adam/AdamW moments to and from the seed
layout (verified before the first value is copied); ``ct.rng_state`` / ``ct.restore_rng`` carry
every RNG a resume needs; ``ckptfmt.torch.distributed`` saves and loads sharded generations
under torchrun. This is the only layer of the library that imports torch at module level.
"""
from .adapter import *  # noqa: F401,F403
from .adapter import __all__ as _adapter_all
from .manager import CheckpointManager
from .resume_check import ResumeRecord
from .rng import *  # noqa: F401,F403
from .rng import __all__ as _rng_all

__all__ = [*_adapter_all, *_rng_all, "CheckpointManager", "ResumeRecord"]
