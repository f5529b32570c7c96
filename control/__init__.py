"""The controller: cluster config -> deploy plan -> per-target drivers; the shadow handshake."""
