"""Memory: which arrays are alive together (``liveness``), and what changes that: layers
recomputed in the backward pass (``remat``) and optimizer state in host memory between
steps (``offload``)."""
