"""What the engine adds on CUDA: a Triton kernel for paged decode attention
(`triton_attention`) and decode steps replayed as CUDA graphs (`graphs`)."""
