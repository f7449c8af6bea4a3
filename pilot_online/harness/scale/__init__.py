"""The scale model: a ViT of PILOT's family pretrained here (``pretrain``), the feature probes
that show it is pretrained (``probe``), and the grid of the paper's experiments on it (``grid``;
``pilot-online scale-model`` runs it). The shipped file's record lives in
``core/scale_backbone.py``, where config resolution reads it."""
