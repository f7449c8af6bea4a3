"""The PILOT-free core: streams, prototypes, FGH, logit masks, metrics, results files and the
synthetic dataset. Needs torch and numpy only; every piece works on any PyTorch model.
"""
