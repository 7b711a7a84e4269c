"""What a plan costs: which collectives XLA's partitioner emits for a partial sum or a
sharding change, and which it combines (``partitioner``: no seconds, so the rules can ask it),
and what collectives, reshards and FLOPs take on the mesh's links and devices (``time``).
"""
