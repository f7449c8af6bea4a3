"""The reproduction harness: the paper's data (``paper``) and protocol (``protocol``,
``presets``), sweeps and their engines, ``reproduce``, the tables, figures and report, the FLOP
estimates, and the scale model (``scale``, ``scale_model``). It drives runs through the layers
below it (core, engine, methods, pilot) and is driven by the CLI; nothing below imports it.
"""
