"""benchmarks.same_lowering --mosaic: the Mosaic kernels' modules taken out of a
program lowered for CUDA (no GPU needed) and compared without locations, so
that a refactor can be shown to leave a kernel's operations as they were."""

import pytest

import ua_kernels
from benchmarks import same_lowering


@pytest.fixture(scope="module")
def modules():
  return same_lowering.mosaic_modules(
      same_lowering.mosaic_lowered_text(ua_kernels, 1024, 64, causal=True))


def test_each_kernel_of_the_call_is_extracted_without_locations(modules):
  names = [same_lowering._kernel_name(m) for m in modules]
  assert names == ["ua_forward_mosaic", "ua_backward_dq_mosaic", "ua_backward_dkv_mosaic"]
  for module in modules:
    assert "loc(" not in module and "wgmma" in module


def test_a_reordered_kernel_is_told_apart_from_a_changed_one(modules):
  forward = modules[0].splitlines()
  body = [i for i, line in enumerate(forward) if '"stable_mosaic_gpu.arith.' in line]
  i, j = body[0], body[-1]
  swapped = list(forward)
  swapped[i], swapped[j] = swapped[j], swapped[i]
  dropped = forward[:j] + forward[j + 1:]
  verdict = lambda new: same_lowering.compare_mosaic(modules, [new, *modules[1:]])
  assert set(verdict(modules[0]).values()) == {"identical"}
  assert verdict("\n".join(swapped))["ua_forward_mosaic"] == "reordered"
  assert verdict("\n".join(dropped))["ua_forward_mosaic"] == "DIFFERENT"
  assert same_lowering.compare_mosaic(modules, modules[:2]) == {"kernels": "DIFFERENT"}
