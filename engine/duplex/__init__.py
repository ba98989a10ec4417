"""The duplex control plane: fences, leases, sessions and the control state machine."""
