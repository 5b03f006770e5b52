"""The compression operator C (QSGD) and its wire format: levels, ω, Elias codes,
bit bounds; each compiled (numba) twin beside the Python it mirrors."""
