"""The online engine: the adapter contract, the single-pass loop, its mixins (P, FGH, ER) and the
session that turns a stream into an accuracy matrix. Needs torch, numpy and tqdm; never PILOT.
"""
