"""The shadow node: receives replicated gradients and keeps a replica of one partition."""
