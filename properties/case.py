"""A Case: everything needed to rebuild one test input exactly, as JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from typing import Any

import numpy as np

FEATURES = ("causal", "window", "segment_ids", "cap", "temperature", "z_loss",
            "gqa", "lse")


@dataclasses.dataclass(frozen=True)
class Case:
  """Static configuration plus the seed the tensors are drawn from."""

  batch: int
  seq_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  causal: bool = False
  window_len: int = 0
  segments: str = "none"          # none | packed | random
  cap_method: str = "none"
  cap_params: tuple[float, ...] = ()
  temperature: str = "none"       # none | ones | uniform | signed | extreme | per_head | scalar
  sm_scale: float | None = None
  z_loss_weight: float = 0.0
  return_lse: bool = False
  distribution: str = "normal"    # normal | large | ties | saturating
  blocks: tuple[int, ...] | None = None
  seed: int = 0

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
    return out

  def groups(self) -> list[str]:
    """Feature groups for the report: features, the cap method and dtype."""
    groups = sorted(self.features()) or ["plain"]
    if self.cap_method != "none":
      groups.append(f"cap:{self.cap_method}")
    groups.append(f"dtype:{self.dtype}")
    return groups

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "Case":
    data = dict(data)
    data["cap_params"] = tuple(data.get("cap_params", ()))
    if data.get("blocks") is not None:
      data["blocks"] = tuple(data["blocks"])
    return cls(**data)

  def digest(self) -> str:
    return hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def versions() -> dict[str, str]:
  import hypothesis
  import jax
  import jaxlib
  return {"python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "numpy": np.__version__,
          "hypothesis": hypothesis.__version__, "backend": jax.default_backend()}


def save_case_file(path, case: Case, prop: str, impl: str, errors: dict,
                   message: str = "") -> None:
  payload = {"property": prop, "impl": impl, "case": case.to_dict(),
             "versions": versions(), "errors": errors, "message": message}
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True, default=float)


def load_case_file(path) -> dict[str, Any]:
  with open(path) as f:
    payload = json.load(f)
  payload["case"] = Case.from_dict(payload["case"])
  return payload
