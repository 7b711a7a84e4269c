"""The cluster as the planner sees it: device meshes and their links (``mesh``), the
hardware of one device (``hardware``), and starting local processes (``launch``)."""
