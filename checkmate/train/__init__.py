"""Training side: ckm ring allreduce, DDP comm hook, replication, bootstrap, restore."""
