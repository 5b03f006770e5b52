"""Ways to run the same chain without Flower in the loop: the local loop and the
vectorised engine."""
