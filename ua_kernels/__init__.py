"""Pallas-Triton kernels for unified attention.

The contract (validation, the cap registry, the reference) lives in
ua_reference; these kernels import it. Cap methods are registered there
(ua_reference.register_cap_method); a fast bfloat16 form of one is registered
here (register_fast_form).
"""

from .attention import SUPPORTED_DTYPES, attention
from .cap_forms import register_fast_form
from .kernel_config import KernelConfig, MosaicTiles

__all__ = ["attention", "KernelConfig", "MosaicTiles", "SUPPORTED_DTYPES", "register_fast_form"]
