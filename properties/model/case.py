"""A Case: everything needed to rebuild one test input exactly, as JSON."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
from typing import Any

import numpy as np

FEATURES = ("causal", "window", "segment_ids", "cap", "temperature", "z_loss",
            "gqa", "lse", "kv_length", "q_offset", "kv_segment_ids", "sinks")
# The features a keyword of the call carries: an implementation whose signature
# takes no such keyword is judged without them (capabilities.declare).
KEYWORD_FEATURES = {"q_offset": ("q_offset", "kv_length"),
                    "kv_segment_ids": ("kv_segment_ids",), "sinks": ("sinks",)}
SINKS = ("none", "normal", "large", "some_minus_inf", "minus_inf")
# Largest |q_offset| a case file may hold (the contract's MAX_POSITION is 2^30).
MAX_CASE_OFFSET = 1 << 20


@dataclasses.dataclass(frozen=True)
class Case:
  """Static configuration plus the seed the tensors are drawn from.

  ``tiles`` = (block_q, block_kv) is handed to an implementation that declares
  ``ua_config`` (docs/PLUGINS.md); None runs its own default tiles.
  ``seq_len`` is the queries' length Tq; ``kv_seq_len`` the keys' (None: Tq);
  ``q_offset`` the offset passed (None: none, the contract's default Tk - Tq);
  ``sinks`` how the per-head sinks are drawn (inputs.py), "none" for no sinks.
  ``sampled_rows``: at lengths a dense float64 oracle cannot follow, the
  oracle judges that many query rows (their cotangents alone drawn nonzero) and
  every key's gradient (runner.Harness; docs/SCALE.md, "Sampled rows").
  """

  batch: int
  seq_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  causal: bool = False
  window_len: int = 0
  segments: str = "none"          # none | packed | random | wide (ids across int32)
  cap_method: str = "none"
  cap_params: tuple[float, ...] = ()
  temperature: str = "none"       # none | ones | uniform | signed | extreme | per_head | scalar
  sm_scale: float | None = None
  z_loss_weight: float = 0.0
  return_lse: bool = False
  # normal | large | ties | saturating | offset | sink_channel, and the activation-like
  # outliers | heavy_tail | correlated (inputs.ACTIVATION_LIKE)
  distribution: str = "normal"
  tiles: tuple[int, int] | None = None
  seed: int = 0
  kv_seq_len: int | None = None
  q_offset: int | None = None
  sinks: str = "none"             # none | normal | large | some_minus_inf | minus_inf
  # Query rows the oracle judges (inputs.sampled_rows); 0: every row.
  sampled_rows: int = 0

  @property
  def tk(self) -> int:
    """The keys' length."""
    return self.seq_len if self.kv_seq_len is None else self.kv_seq_len

  @property
  def offset(self) -> int:
    """Where query 0 sits among the keys: q_offset, or the contract's default."""
    return self.tk - self.seq_len if self.q_offset is None else self.q_offset

  @property
  def passes_kv_segment_ids(self) -> bool:
    """Whether the keys' own segment ids are passed: with segments, whenever
    queries and keys are not one sequence (other lengths, or an offset)."""
    return self.segments != "none" and (self.tk != self.seq_len or self.q_offset is not None)

  def features(self) -> set[str]:
    """The contract features this case exercises (for ua_unsupported)."""
    out = set()
    if self.causal:
      out.add("causal")
    if self.window_len:
      out.add("window")
    if self.segments != "none":
      out.add("segment_ids")
    if self.cap_method != "none":
      out.add("cap")
    if self.temperature != "none":
      out.add("temperature")
    if self.z_loss_weight:
      out.add("z_loss")
    if self.num_q_heads != self.num_kv_heads:
      out.add("gqa")
    if self.return_lse:
      out.add("lse")
    if self.tk != self.seq_len:
      out.add("kv_length")
    if self.q_offset is not None:
      out.add("q_offset")
    if self.passes_kv_segment_ids:
      out.add("kv_segment_ids")
    if self.sinks != "none":
      out.add("sinks")
    return out

  def groups(self) -> list[str]:
    """Feature groups for the report: features, the cap method and dtype."""
    groups = sorted(self.features()) or ["plain"]
    if self.cap_method != "none":
      groups.append(f"cap:{self.cap_method}")
    groups.append(f"dtype:{self.dtype}")
    d = self.head_dim
    groups.append("head_dim:" + ("<=64" if d <= 64 else "65-128" if d <= 128 else ">128"))
    if self.segments != "none":
      groups.append(f"segment_ids:{self.segments}")
    if self.tk != self.seq_len:
      groups.append("kv_length:" + ("decode" if self.seq_len <= 16 else
                                    "Tq<Tk" if self.seq_len < self.tk else "Tq>Tk"))
    return groups

  def static_key(self) -> tuple:
    """What a compile depends on: not the seed, nor the choices that only change
    input values (the value distribution, how segment ids and full-size
    temperatures are drawn). Cases with equal keys share compiled callables."""
    full_size = self.temperature in ("ones", "uniform", "signed", "extreme")
    return dataclasses.astuple(dataclasses.replace(
        self, seed=0, distribution="normal",
        segments="packed" if self.segments != "none" else "none",
        temperature="uniform" if full_size else self.temperature,
        sinks="normal" if self.sinks != "none" else "none"))

  def to_dict(self) -> dict[str, Any]:
    """The fields, those of queries and keys of other lengths and of sinks
    only where set: a case of one length without sinks keeps the file and
    digest it had before they existed."""
    data = dataclasses.asdict(self)
    for name, default in _LATER_FIELDS.items():
      if data[name] == default:
        del data[name]
    return data

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "Case":
    data = dict(data)
    data["cap_params"] = tuple(data.get("cap_params", ()))
    if "blocks" in data:  # files written before tiles: (bq, bkv, bkv, bq, bq, bkv) or null
      blocks = data.pop("blocks")
      if blocks is not None:
        bq, bkv = blocks[0], blocks[1]
        if tuple(blocks) != (bq, bkv, bkv, bq, bq, bkv):
          raise ValueError(f"case file blocks {blocks} are not a (block_q, block_kv) pair")
        data["tiles"] = (bq, bkv)
    if data.get("tiles") is not None:
      data["tiles"] = tuple(data["tiles"])
    return cls(**data)

  def invalid(self) -> str | None:
    """What makes this case one the suite would never draw (a field and what
    it must be), or None: a case file edited by hand, or of another version,
    is refused rather than run as a false reproduction."""
    from ua_reference.caps import CAP_METHODS
    positive = ("batch", "seq_len", "num_q_heads", "num_kv_heads", "head_dim")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return f"{name} must be a positive int, got {value!r}"
    for name in ("kv_seq_len", "q_offset"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        return f"{name} must be null or an int, got {value!r}"
    if self.kv_seq_len is not None and self.kv_seq_len < 1:
      return f"kv_seq_len must be null or a positive int, got {self.kv_seq_len!r}"
    if self.q_offset is not None and abs(self.q_offset) > MAX_CASE_OFFSET:
      return f"q_offset must be null or within +-{MAX_CASE_OFFSET}, got {self.q_offset!r}"
    if self.num_q_heads % self.num_kv_heads:
      return (f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
              f"({self.num_kv_heads})")
    kinds = {"dtype": ("float32", "bfloat16", "float16"),
             "segments": ("none", "packed", "random", "wide"),
             "temperature": ("none", "ones", "uniform", "signed", "extreme", "per_head",
                             "scalar"),
             "distribution": ("normal", "large", "ties", "saturating", "offset",
                              "sink_channel", "outliers", "heavy_tail", "correlated"),
             "sinks": SINKS}
    for name, allowed in kinds.items():
      if getattr(self, name) not in allowed:
        return f"{name} must be one of {allowed}, got {getattr(self, name)!r}"
    if not isinstance(self.sampled_rows, int) or self.sampled_rows < 0:
      return f"sampled_rows must be an int >= 0, got {self.sampled_rows!r}"
    if not isinstance(self.window_len, int) or self.window_len < 0:
      return f"window_len must be an int >= 0, got {self.window_len!r}"
    if self.cap_method not in CAP_METHODS:
      return (f"cap_method {self.cap_method!r} is not registered (registered: "
              f"{sorted(CAP_METHODS)}; --import the module that registers it)")
    wanted = len(CAP_METHODS[self.cap_method].param_names)
    if len(self.cap_params) != wanted or not all(
        isinstance(p, (int, float)) and np.isfinite(p) and p > 0 for p in self.cap_params):
      return f"cap_params must be {wanted} finite positive numbers, got {self.cap_params!r}"
    if self.sm_scale is not None and not (isinstance(self.sm_scale, (int, float))
                                          and np.isfinite(self.sm_scale)):
      return f"sm_scale must be null or a finite number, got {self.sm_scale!r}"
    if not (isinstance(self.z_loss_weight, (int, float)) and np.isfinite(self.z_loss_weight)
            and self.z_loss_weight >= 0):
      return f"z_loss_weight must be a finite number >= 0, got {self.z_loss_weight!r}"
    if self.tiles is not None and (len(self.tiles) != 2 or not all(
        isinstance(b, int) and b > 0 for b in self.tiles)):
      return f"tiles must be null or two positive ints, got {self.tiles!r}"
    if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
      return f"seed must be an int in [0, 2^32), got {self.seed!r}"
    return None

  def digest(self) -> str:
    return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

  def static_digest(self) -> str:
    """The digest of static_key: cases that share compiled executables share it."""
    return hashlib.sha1(repr(self.static_key()).encode()).hexdigest()[:12]


_LATER_FIELDS = {"kv_seq_len": None, "q_offset": None, "sinks": "none", "sampled_rows": 0}


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
  import hypothesis
  import jax
  import jaxlib
  out = {"python": platform.python_version(), "jax": jax.__version__,
         "jaxlib": jaxlib.__version__, "numpy": np.__version__,
         "hypothesis": hypothesis.__version__, "backend": jax.default_backend()}
  if out["backend"] == "gpu":
    out["device"] = jax.devices()[0].device_kind
  return out


def write_case_file(path, case: Case, prop: str, impl: str, *, status: str,
                    errors=(), message: str = "", imports=(), replay: str = "") -> None:
  """Writes (atomically) one case file. ``status``: running (written before the
  case runs, so that a crash leaves it behind), failed, harness (the oracle or
  reference raised), crashed or timeout."""
  payload = {"property": prop, "impl": impl, "case": case.to_dict(), "status": status,
             "versions": dict(versions()), "errors": list(errors), "message": message,
             "imports": list(imports), "replay": replay,
             "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pid": os.getpid()}
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True, default=float)
  os.replace(tmp, path)


def load_case_file(path) -> dict[str, Any]:
  with open(path) as f:
    payload = json.load(f)
  payload["case"] = Case.from_dict(payload["case"])
  return payload
