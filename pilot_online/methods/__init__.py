"""One file per online method, named like PILOT's ``models/`` files so that they diff side by side.

Each module here holds the :class:`~pilot_online.engine.adapter.MethodAdapter` of one method (or a
family: ``finetune.py`` and ``linear_probe.py`` also hold their experience-replay rows), registered
with ``@register_method`` and its card. Nothing here imports them: the registry finds every module
of this folder and imports it the first time a method is listed or looked up
(``engine/registry.py``), so a new method is one more file and no other edit.
"""
