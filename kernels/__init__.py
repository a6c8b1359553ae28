"""Fused ops for dgemma and their torch references (installed as `dgcli.kernels`, never as top-level `kernels`)."""
