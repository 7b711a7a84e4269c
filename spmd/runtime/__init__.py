"""Running a plan: the step jitted under its shardings and compiled with per-compile XLA
options (``compile``), with sharding constraints inside the step (``constrain``). A pipeline
runtime belongs here too."""
