"""`checkmate launch` (torch elastic with Checkmate), local shadows, and `checkmate plan`."""
