"""The mathematics of QLSD with no Flower, no files: random streams, participation, the
oracles H_i, the server step, θ*."""
