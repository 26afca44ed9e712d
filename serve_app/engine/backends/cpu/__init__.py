"""What the engine adds on CPU: its own C++ kernels (`kernels`, sources in csrc/) for paged
decode attention, the argmax and GEMMs that stream packed weights (`gemm`), and decoder layers
fused around them (`layers`)."""
