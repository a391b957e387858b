"""Running a scheduled step on the device: packing its inputs, the model forward (eagerly, from
a CUDA graph, or overlapped with the previous step), sampling, and the CPU thread governor."""
