"""The Pallas-Triton backend: every dtype and head dim, compiled on any GPU or
run in the Pallas interpreter. launch (the pallas_calls and their layout),
kernels (forward, dq, dk/dv), tuned (its table of tiles, warps and stages)."""
