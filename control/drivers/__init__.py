"""Per-target drivers that apply a deploy plan."""
