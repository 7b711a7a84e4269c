"""What a plan costs: which collectives XLA emits (``partitioner``, no seconds) and what they
and the compute take (``time``)."""
