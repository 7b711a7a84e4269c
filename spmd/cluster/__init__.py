"""The cluster as the planner sees it: device meshes, their submeshes and links (``mesh``),
the hardware of one device (``hardware``), and multi-process runs (``distributed``)."""
