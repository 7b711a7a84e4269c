"""The intra-operator search: the cost graph of a step (``costgraph``) and the search and
scoring over it (``intra_op``)."""
