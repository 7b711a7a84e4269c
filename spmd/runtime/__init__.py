"""Running a plan: the step jitted under its shardings, donated, compiled with per-compile XLA
options and kept (``compile``: ``prepare`` for a step, ``jit_region`` for a region on its
submesh, what a pipeline stage runs), with sharding constraints inside the step
(``constrain``), and its NNX state read and written back on repeat calls without walking
the graph (``nodes``); a pipeline plan's tasks driven in its schedule (``pipeline``), with
copies between stages that work across processes (``transfer``). A plan itself is data (``spmd.plan``); everything that runs it lives
here.
"""
