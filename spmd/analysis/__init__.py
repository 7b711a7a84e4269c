"""What XLA emitted for a compiled step, and whether the plan predicted it: the optimized HLO
parsed (``hlo``), reported (``report``: ``spmd.analyze``), and every plan of a step compiled
side by side and judged against its prediction (``verify``: ``spmd compare``).
"""
