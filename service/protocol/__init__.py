"""Wire protocols: v2 (Open Inference Protocol, with Triton's binary tensors) and v1 predict."""
