"""This repository's own test configuration.

The suite's options (--impl, --ua-*), fixtures and profiles come from the
installed package's pytest plugin (properties/plugin.py, entry point
``pytest11``), the same plugin any user's CI loads; nothing is configured here
that an installed suite would lack. Kernel unit tests that need a KernelConfig
build their own.
"""
