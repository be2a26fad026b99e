"""An implementation under test and what it declares it can do (docs/PLUGINS.md).

Any callable with the contract's signature can be verified. It may declare,
as attributes of the callable:

- ``ua_unsupported``: contract features it lacks (names from case.FEATURES);
- ``ua_dtypes``: the input dtype names it supports;
- ``ua_head_dims``: the head dims it supports, a collection of ints or a predicate;
- ``ua_block_sizes``: the tile lengths along the sequence it uses; the suite
  then draws sequence lengths and windows around their edges in every profile;
- ``ua_config``: ``(block_q, block_kv) -> config``: it takes a ``config``
  keyword choosing its tiles, and the suite passes one built this way;
- ``ua_cap_methods``: the registered cap methods it supports (default: all);
- ``ua_cap_forms``: ``(cap_method) -> (forward, grad) | None``: its own
  (faster) forms of a cap, which the cap checks compare with the exact ones;
- ``ua_seq_len_multiple``: an int: it takes only sequence lengths that are a
  multiple of it (a sharded op: twice its shard count); the suite draws
  lengths rounded up to one;
- ``ua_unsharded``: ``"module:function"``, the same op on one device (a sharded
  op's counterpart): the suite then checks the two against each other on every
  case of ``sharded_equals_unsharded``.

Nothing else whose name starts with ``ua_`` is accepted: a misspelt
declaration is an error, not a silently wider test.

A callable whose signature names no ``q_offset`` keyword is judged on
queries and keys of one length (features ``q_offset`` and ``kv_length``);
none naming ``kv_segment_ids`` or ``sinks``, without those. ``**kwargs``
names none (it often swallows what a kernel declares unsupported); a wrapper
made with ``functools.wraps`` has its target's signature. A kernel written
before the contract had them keeps the verdict it had (docs/PLUGINS.md, "What
the signature says").
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from .case import FEATURES, KEYWORD_FEATURES, Case

DTYPES = ("float32", "bfloat16", "float16")
KNOWN_ATTRIBUTES = ("ua_unsupported", "ua_dtypes", "ua_head_dims", "ua_block_sizes",
                    "ua_config", "ua_cap_methods", "ua_cap_forms", "ua_seq_len_multiple",
                    "ua_unsharded", "ua_deterministic")


class CapabilityError(ValueError):
  """A capability declaration that the suite cannot honour."""


def _all_head_dims(d: int) -> bool:
  return True


# Head dims tried when a profile's own draw none an implementation declares: the
# widths production kernels take (FA3, splash and cuDNN's fast paths take a few
# of these only), so a narrow kernel still gets a full campaign.
HEAD_DIM_LADDER = (8, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
  """A callable under test, its name (``module:function``) and its declarations."""

  name: str
  fn: Callable
  unsupported: frozenset = frozenset()
  dtypes: tuple[str, ...] = DTYPES
  head_dims: Callable[[int], bool] = _all_head_dims
  block_sizes: tuple[int, ...] = ()
  config: Callable[[int, int], Any] | None = None
  cap_methods: frozenset | None = None   # None: every registered method
  cap_forms: Callable[[str], Any] | None = None
  seq_len_multiple: int = 1
  unsharded: str | None = None  # module:function of the same op on one device
  # Whether reruns are bitwise identical (ua_deterministic; default True): a kernel whose
  # reductions the hardware orders (atomics) declares False, and its reruns are held to its
  # tolerance instead (registry: deterministic, reruns_within_tolerance).
  deterministic: bool = True
  declared_head_dims: tuple[int, ...] = ()  # ua_head_dims when a collection
  # The features in ``unsupported`` because the signature takes no keyword for them.
  unsigned: frozenset = frozenset()

  def lacks(self, features) -> str:
    """Why ``features`` (all in ``unsupported``) are not drawn, in words."""
    features = set(features)
    declared, unsigned = sorted(features - self.unsigned), sorted(features & self.unsigned)
    parts = [f"declares {declared} unsupported"] if declared else []
    if unsigned:
      keywords = sorted(k for k, fs in KEYWORD_FEATURES.items() if set(fs) & set(unsigned))
      parts.append(f"takes no {' or '.join(keywords)} keyword (so not {unsigned})")
    return " and ".join(parts)

  def head_dim_choices(self, wanted: tuple[int, ...]) -> tuple[int, ...]:
    """The head dims to draw where a profile wants ``wanted`` (repeats weight
    the draw): those it declares; if none, the ones it declares among
    HEAD_DIM_LADDER and its own collection, so that a kernel of D in
    {128, 256} alone is drawn at its own widths, not refused."""
    dims = tuple(d for d in wanted if self.head_dims(d))
    if dims:
      return dims
    return tuple(sorted(d for d in set(HEAD_DIM_LADDER) | set(self.declared_head_dims)
                        if self.head_dims(d)))

  def supports(self, case: Case) -> str | None:
    """None if the case is within the declarations, else why not."""
    missing = case.features() & self.unsupported
    if missing:
      return self.lacks(missing)
    if case.dtype not in self.dtypes:
      return f"declares dtypes {self.dtypes}, not {case.dtype}"
    if not self.head_dims(case.head_dim):
      return f"declares head dim {case.head_dim} unsupported"
    if not self.supports_cap(case.cap_method):
      return f"declares cap method {case.cap_method!r} unsupported"
    if case.seq_len % self.seq_len_multiple:
      return f"declares sequence lengths that are multiples of {self.seq_len_multiple}"
    return None

  def fit_seq_len(self, t: int) -> int:
    """``t`` rounded up to a length the implementation takes."""
    return -(-t // self.seq_len_multiple) * self.seq_len_multiple

  def supports_cap(self, name: str) -> bool:
    return name == "none" or self.cap_methods is None or name in self.cap_methods

  def call_kwargs(self, case: Case) -> dict:
    """The contract's static keyword arguments for this case. The case's tiles
    reach only an implementation that takes a config (``ua_config``); others
    run the same inputs with their own."""
    kwargs = dict(causal=case.causal, window_len=case.window_len,
                  cap_method=case.cap_method, cap_params=case.cap_params,
                  sm_scale=case.sm_scale, z_loss_weight=case.z_loss_weight,
                  return_lse=case.return_lse)
    if case.q_offset is not None:  # else the contract's default, not passed
      kwargs["q_offset"] = case.q_offset
    if case.tiles is not None and self.config is not None:
      kwargs["config"] = self.config(*case.tiles)
    return kwargs


def _head_dims(name: str, value) -> Callable[[int], bool]:
  if callable(value):
    return value
  try:
    dims = frozenset(value)
  except TypeError:
    raise CapabilityError(f"{name}.ua_head_dims must be a collection of ints or a "
                          f"predicate, got {value!r}") from None
  if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                         for d in dims):
    raise CapabilityError(f"{name}.ua_head_dims must hold positive ints, got {value!r}")
  return dims.__contains__


def _names(name: str, attr: str, value, what: str) -> tuple:
  """A collection of names; a lone string is refused (iterating it would read
  its letters as names)."""
  if isinstance(value, str):
    raise CapabilityError(f"{name}.{attr} must be a collection of {what}, not the string "
                          f"{value!r} (write ({value!r},))")
  try:
    return tuple(value)
  except TypeError:
    raise CapabilityError(f"{name}.{attr} must be a collection of {what}, "
                          f"got {value!r}") from None


def _block_sizes(name: str, value) -> tuple[int, ...]:
  try:
    if isinstance(value, str):
      raise TypeError
    sizes = tuple(value)
  except TypeError:
    raise CapabilityError(f"{name}.ua_block_sizes must be a tuple of ints, got {value!r}") from None
  if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                          for b in sizes):
    raise CapabilityError(f"{name}.ua_block_sizes must be positive ints, got {value!r}")
  return tuple(sorted(set(sizes)))


def declare(name: str, fn: Callable) -> Implementation:
  """Reads and checks the ``ua_*`` declarations of ``fn`` (see the module doc)."""
  if not callable(fn):
    raise TypeError(f"{name} is not callable")
  unknown = sorted(a for a in dir(fn) if a.startswith("ua_") and a not in KNOWN_ATTRIBUTES)
  if unknown:
    raise CapabilityError(f"{name} declares unknown attributes {unknown}; "
                          f"known: {list(KNOWN_ATTRIBUTES)}")
  kwargs: dict[str, Any] = {}
  unsupported = frozenset(_names(name, "ua_unsupported", getattr(fn, "ua_unsupported", ()),
                                 "feature names"))
  if unsupported - set(FEATURES):
    raise CapabilityError(f"{name}.ua_unsupported names unknown features "
                          f"{sorted(unsupported - set(FEATURES))}; known: {FEATURES}")
  unsigned = _unsigned(fn)
  kwargs["unsupported"] = unsupported | unsigned
  kwargs["unsigned"] = unsigned - unsupported
  if hasattr(fn, "ua_dtypes"):
    dtypes = _names(name, "ua_dtypes", getattr(fn, "ua_dtypes"), "dtype names")
    if not dtypes or set(dtypes) - set(DTYPES):
      raise CapabilityError(f"{name}.ua_dtypes must name some of {DTYPES}, got {dtypes!r}")
    kwargs["dtypes"] = tuple(d for d in DTYPES if d in dtypes)
  if hasattr(fn, "ua_head_dims"):
    kwargs["head_dims"] = _head_dims(name, fn.ua_head_dims)
    if not callable(fn.ua_head_dims):
      kwargs["declared_head_dims"] = tuple(sorted(fn.ua_head_dims))
  if hasattr(fn, "ua_block_sizes"):
    kwargs["block_sizes"] = _block_sizes(name, fn.ua_block_sizes)
  if hasattr(fn, "ua_cap_methods"):
    methods = getattr(fn, "ua_cap_methods")
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
      raise CapabilityError(f"{name}.ua_cap_methods must be a collection of cap method "
                            f"names, got {methods!r}")
    from ua_reference.caps import CAP_METHODS
    unknown = sorted(set(methods) - set(CAP_METHODS))
    if unknown:
      raise CapabilityError(f"{name}.ua_cap_methods names unregistered cap methods {unknown}; "
                            f"registered: {sorted(CAP_METHODS)}")
    kwargs["cap_methods"] = frozenset(methods)
  if hasattr(fn, "ua_seq_len_multiple"):
    multiple = fn.ua_seq_len_multiple
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
      raise CapabilityError(f"{name}.ua_seq_len_multiple must be a positive int, "
                            f"got {multiple!r}")
    kwargs["seq_len_multiple"] = multiple
  if hasattr(fn, "ua_unsharded"):
    single = fn.ua_unsharded
    if not isinstance(single, str) or ":" not in single:
      raise CapabilityError(f"{name}.ua_unsharded must name the single-device op as "
                            f"'module:function', got {single!r}")
    kwargs["unsharded"] = single
  if hasattr(fn, "ua_deterministic"):
    if not isinstance(fn.ua_deterministic, bool):
      raise CapabilityError(f"{name}.ua_deterministic must be True or False, "
                            f"got {fn.ua_deterministic!r}")
    kwargs["deterministic"] = fn.ua_deterministic
  for attr in ("ua_config", "ua_cap_forms"):
    if hasattr(fn, attr):
      if not callable(getattr(fn, attr)):
        raise CapabilityError(f"{name}.{attr} must be callable, got {getattr(fn, attr)!r}")
      kwargs[attr[3:]] = getattr(fn, attr)
  return Implementation(name, fn, **kwargs)


def _unsigned(fn) -> frozenset:
  """The features of the keywords ``fn``'s signature does not name
  (case.KEYWORD_FEATURES; ``**kwargs`` names none); none where it has no
  signature Python can read."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return frozenset()
  names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}
  return frozenset(f for keyword, features in KEYWORD_FEATURES.items() if keyword not in names
                   for f in features)


# The peers' adapters' modules before properties/peers/ held them: case files
# and commands that name one still load it, under the name they give.
MOVED_MODULES = {f"properties.{name}": f"properties.peers.{name}"
                 for name in ("impls", "impls_splash", "impls_tokamax")}


def load_impl(spec: str) -> Implementation:
  """Imports ``module:function`` (the function part may be dotted) with its declarations."""
  if not isinstance(spec, str) or ":" not in spec:
    raise ValueError(f"--impl must look like module:function, got {spec!r}")
  module_name, attr = spec.split(":", 1)
  try:
    obj = importlib.import_module(MOVED_MODULES.get(module_name, module_name))
  except ModuleNotFoundError as exc:
    if exc.name is None or not module_name.startswith(exc.name):
      raise  # the module exists; something it imports does not
    raise ModuleNotFoundError(f"{exc} (is its directory on PYTHONPATH?)",
                              name=exc.name) from exc
  for part in attr.split("."):
    obj = getattr(obj, part)
  return declare(spec, obj)
