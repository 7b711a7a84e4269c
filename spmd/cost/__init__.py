"""What a plan costs: collective, resharding and compute times (``time``)."""
