"""One file per online method, named like PILOT's ``models/`` files so that they diff side by side.

Each file holds one :class:`~pilot_online.engine.adapter.MethodAdapter` registered with
``@register_method`` (``finetune.py`` and ``linear_probe.py`` also hold their experience-replay
rows); importing this package registers them all. A new method is one more file here and one more
name in the import below (ruff.toml exempts this file from F401: the imports register, nothing reads
the names).
"""

from . import (
    aper_adapter,
    aper_finetune,
    aper_ssf,
    aper_vpt,
    coda_prompt,
    cofima,
    coil,
    convprompt,
    der,
    dgr,
    dualprompt,
    duct,
    ease,
    fecam,
    finetune,
    foster,
    icarl,
    l2p,
    lae,
    linear_probe,
    memo,
    mos,
    mvp,
    olora,
    ranpac,
    simplecil,
    slca,
)
