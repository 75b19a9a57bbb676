"""The resume-verification protocol of seed 001: continuous vs cut vs resumed vs
resumed-without-RNG, each in a fresh process, compared step by step."""
from .protocol import Deviation, Protocol, VerifyIncomplete, check_pair, compare, verify_resume

__all__ = ["Deviation", "Protocol", "VerifyIncomplete", "check_pair", "compare", "verify_resume"]
