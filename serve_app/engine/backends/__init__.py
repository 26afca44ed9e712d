"""The part of the engine that touches a device: the model runner and what each device adds.

`runner.ModelRunner` loads the model, owns the paged KV cache and runs a step's forward pass; it
is the same on every device. What differs lives in one sub-package per device: `cpu` (the
engine's own C++ kernels, fused decoder layers, packed GEMMs), `cuda` (a Triton decode kernel,
decode steps replayed as CUDA graphs) and `npu` (torch_npu's fused attention operators).
`attention` is the torch implementation every device falls back to, `metadata` what a step
tells each layer's attention, `device` how the device and the dtype are chosen.
"""
