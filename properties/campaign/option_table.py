"""The suite's options, declared once: the plugin adds each as ``--ua-NAME``
(``--impl`` as itself; options.py) and ua-verify as ``--NAME``
(properties/cli/verify.py), with the same help and the same checks, so that
the two spellings cannot drift apart (docs/PLUGINS.md, docs/VERIFICATION.md).

The standard library only at import: the plugin loads this in every pytest
session of the environment, ua-verify before it imports pytest."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from ..run.loading import DEFAULT_IMPL

# A check: (the option as its user spelled it, its value) -> what is wrong, or None.
Check = Callable[[str, Any], "str | None"]


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of the suite. ``help`` names the other options as
  ``{--name}``, written ``--ua-name`` or ``--name`` by whichever front end
  shows it."""

  name: str  # ua-verify's --NAME, the plugin's --ua-NAME
  help: str
  type: type = str
  default: Any = None
  metavar: str | None = None
  check: Check | None = None  # run on every value given (not on None or "")
  prefixed: bool = True  # False: the plugin spells it as ua-verify does (--impl)
  in_verify: bool = True  # False: the plugin's only (ua-verify passes it after --)
  verify_dest: str | None = None  # ua-verify's attribute, where the name is a keyword

  @property
  def plugin_flag(self) -> str:
    return f"--ua-{self.name}" if self.prefixed else f"--{self.name}"

  @property
  def plugin_dest(self) -> str:
    """The name of ``config.getoption``."""
    return self.plugin_flag[2:].replace("-", "_")

  @property
  def verify_flag(self) -> str:
    return f"--{self.name}"

  @property
  def dest(self) -> str:
    """ua-verify's attribute of its parsed arguments."""
    return self.verify_dest or self.name.replace("-", "_")

  def help_for(self, plugin: bool) -> str:
    """The help, naming the other options as this front end spells them."""
    return self.help.format_map({o.verify_flag: o.plugin_flag if plugin else o.verify_flag
                                 for o in OPTIONS})

  def problem(self, value, plugin: bool) -> str | None:
    """What is wrong with ``value``, named as the front end's user wrote it."""
    if self.check is None or value is None or value == "":
      return None
    return self.check(self.plugin_flag if plugin else self.verify_flag, value)


def _at_least(low: float) -> Check:
  def check(flag, value):
    return None if value >= low else f"{flag} must be at least {low:g}, got {value}"
  return check


def _report(flag, path):
  folder = os.path.dirname(os.path.abspath(path))
  return None if os.path.isdir(folder) else f"{flag} {path}: no directory {folder}"


def _failures(flag, path):
  if os.path.exists(path) and not os.path.isdir(path):
    return f"{flag} {path}: exists and is not a directory"
  return None


def _database(flag, value):
  """A Redis URL parses, its package imports and its server answers PING."""
  from .databases import DatabaseOptionError, check_option
  try:
    check_option(flag, value)
  except DatabaseOptionError as exc:
    return str(exc)
  return None


def _baseline(flag, path):
  from ..judge.gates import load_baseline
  try:
    load_baseline(path)
  except (OSError, ValueError) as exc:
    return f"{flag} {path}: {exc}"
  return None


OPTIONS = (
    Option("impl", "implementation under test, as module:function", default=DEFAULT_IMPL,
           prefixed=False),  # checked by loading it, inside pytest (options.py)
    Option("import", "comma-separated modules that register cap methods", default="",
           verify_dest="imports"),  # checked by importing them (options.py, verify.py)
    Option("report", "write the JSON report here", check=_report),
    Option("failures", "directory of case files", default="ua-failures", check=_failures),
    Option("case-timeout",
           "seconds after which a case counts as hung (ends its worker); default: the "
           "profile's base, 600 or on gpu/tpu 900, plus a second per 1e8 multiply-adds of "
           "the case; under {--minutes} at most 300 s past the box's end plus that share",
           type=float),
    Option("minutes", "time box: no case starts after it (tests not started within it are "
           "skipped)", type=float, check=_at_least(0)),  # 0: a spent box, every test skipped
    Option("oracle-chunks", "tests per dtype of each oracle property (default: the "
           "profile's); more than the profile's run after every other test", type=int),
    Option("database",
           "Hypothesis example database: a directory (default .hypothesis/ua-examples) or a "
           "Redis URL redis://HOST:PORT/DB (joined to the default directory)",
           check=_database),
    Option("shared-database",
           "example database combined with {--database}: a directory (read only) or a Redis "
           "URL redis://HOST:PORT/DB (read and written: campaigns on several hosts replay "
           "each other's failures)", check=_database),
    Option("compile-cache", "directory of JAX's persistent compilation cache"),
    Option("compile-threads",
           "threads an oracle case's executables (the implementation's VJP and plain call, "
           "the oracle, the reference) compile on at once", type=int, default=1,
           check=_at_least(1)),
    Option("seeds", "input seeds per drawn configuration of an oracle property (default: "
           "the profile's)", type=int, check=_at_least(1)),
    Option("max-examples",
           "at most this many drawn configurations per test (default: the profile's), for a "
           "quick run; with {--seeds}, more cases per compile", type=int,
           check=_at_least(1), in_verify=False),
    Option("save-baseline",
           "write every case's error/tolerance per output to FILE (a precision baseline for "
           "{--baseline}; the ci profile draws the same cases each run)", metavar="FILE"),
    Option("baseline", "fail when the errors grew significantly against FILE's cases "
           "(written by {--save-baseline})", metavar="FILE", check=_baseline),
)
