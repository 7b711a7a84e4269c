"""Memory: which arrays are alive together (``liveness``). Rematerialization and host
offload, which change what is live when, belong here."""
