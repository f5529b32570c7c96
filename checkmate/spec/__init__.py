"""What is checkpointed: the model spec (parameters, groups, buckets), its schema, and the
partition cut of the flat space."""
