"""Cost models: every formula the course predicts with (alpha-beta, PS vs all-reduce, decentralized, layouts)."""
