"""The ckm protocol: wire format and its generated views, data MACs, job-secret authentication,
the controller handshake, repair messages, and the shadow service's frames."""
