"""The intra-operator search: a step (or a region of one) on a mesh (or submesh).

Data flows through one module each: ``costgraph`` prices every node's strategies and every
reshard once per step on the mesh, whatever is pinned; ``encode`` lays it out, under one set
of pins, as the solver's flat request (``spmd.solver``) and maps the answer back;
``predict`` evaluates the very same numbers for the chosen plan (``Prediction``);
``intra_op`` searches and scores on one cost graph (``IntraOp``); ``regions`` does it for a
range of layers on a submesh, identical ranges served from a cache.
"""
