"""Pallas-Triton kernels for unified attention."""

from .attention import SUPPORTED_DTYPES, attention
from .cap_functions import CAP_METHODS, CapMethod, get_cap_method, register_cap_method
from .contract import StaticSpec, validate
from .kernel_config import KernelConfig

__all__ = ["attention", "KernelConfig", "CAP_METHODS", "CapMethod", "get_cap_method",
           "register_cap_method", "StaticSpec", "validate", "SUPPORTED_DTYPES"]
