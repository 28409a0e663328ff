"""The `symm_fused_*` kernels: the epilogue with its all-reduce over PyTorch symmetric memory (no
NVLink multicast), world size 2-8 on one node.

- `protocol`: the workspace layouts (`ONESHOT`, `TWOSHOT`: bytes, state words, capacity), the
  sentinel, the status bits and the layer record every launch binds once (pure host
  code, no Triton).
- `device`: the device-side helpers both layouts use (waits, error words, peer pointers).
- `oneshot` (+ `oneshot_configs`): one launch per call, every rank's partial pushed to every rank.
- `twoshot*`: the chunked two-shot pipeline (reduce-scatter + all-gather), one launch per stage.
"""
