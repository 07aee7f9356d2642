"""Measurement: the tolerance rule and `verify`, FLOP and byte counts, timing beside the peers, the kernel roofline,
board energy and plots."""
