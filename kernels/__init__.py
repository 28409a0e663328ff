"""Our GPU kernels (Triton), installed as `fusion_bridge.kernels`.

Each kernel has a pure-torch reference in fusion_bridge.torch_math / fusion_bridge.quant_ref and a
parity
test under tests/. Under TRITON_INTERPRET=1 (set before import) they run on CPU tensors, which is
how CI
tests them. `ops` registers them as torch custom ops (CUDA graphs, torch.compile).
"""
