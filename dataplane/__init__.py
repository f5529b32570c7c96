"""Linux kernel dataplane: the tc-eBPF Checkmate switch and the host transports."""
