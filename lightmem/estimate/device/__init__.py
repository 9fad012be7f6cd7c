"""What the device does with a traced step: CUDA's op rules and block sizes, kernels whose fakes
allocate otherwise, the caching allocator's replay, and one step run as the device runs it."""
