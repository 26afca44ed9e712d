"""What the engine adds on Ascend NPUs: attention through torch_npu's fused operators
(`attention`)."""
