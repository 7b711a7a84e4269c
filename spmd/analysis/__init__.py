"""What XLA emitted for a compiled step: its optimized HLO parsed (``hlo``) and reported
(``report``)."""
