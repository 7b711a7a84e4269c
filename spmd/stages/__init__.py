"""The inter-op level: a step cut into pipeline stages (``split``) and the order their
microbatches run in (``schedule``)."""
