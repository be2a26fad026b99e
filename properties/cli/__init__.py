"""Command-line entry points: ua-verify, ua-repro, ua-fuzz (docs/VERIFICATION.md).

They work from an installed package in any directory; ``python -m
properties.cli`` is ua-verify.
"""

from .fuzz import fuzz_main
from .repro import repro_main
from .verify import verify_main

__all__ = ["fuzz_main", "repro_main", "verify_main"]
