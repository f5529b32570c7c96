"""The cluster config (hosts, switch, shadows, ports) and its schema."""
