"""meshrl: RL with verifiable rewards for language models that does not collapse.

Layers (imports point down only):
1. ``meshrl.algos`` / ``meshrl.stats``: pure tensor functions and registries.
2. ``meshrl.mesh`` / ``meshrl.diagnostics``: coach prompting, strategy balancing, MEI, coupling kernel.
3. engine, in order: ``meshrl.rewards`` / ``tasks`` / ``models`` / ``runs`` / ``doctor``; ``meshrl.rollout`` /
   ``agents``; ``meshrl.trainer``; ``meshrl.evaluation`` / ``analysis`` / ``testbed``.
4. faces: ``meshrl.cli``, ``meshrl.export``, ``meshrl.integrations``, ``meshrl.report``.
"""

__version__ = "0.1.0"
