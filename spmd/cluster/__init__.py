"""The cluster as the planner sees it: device meshes, their submeshes and links (``mesh``),
the hardware of one device (``hardware``), the devices a process will have (``devices``), and
multi-process runs (``distributed``)."""
