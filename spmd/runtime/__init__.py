"""Running a plan: sharding constraints inside the step (``constrain``)."""
