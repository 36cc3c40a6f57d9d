"""Kernels (Pallas, and a C++ CPU kernel called through XLA's FFI), each beside its pure-jnp reference."""
