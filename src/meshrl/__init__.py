"""meshrl: RL with verifiable rewards for language models that does not collapse.

Layers (imports point down only):
1. ``meshrl.algos`` / ``meshrl.stats``: pure tensor functions and registries.
2. ``meshrl.mesh`` / ``meshrl.diagnostics``: coach prompting, strategy balancing, MEI, coupling kernel.
3. engine: ``meshrl.models``, ``meshrl.rollout``, ``meshrl.rewards``, ``meshrl.tasks``, ``meshrl.trainer``.
4. faces: ``meshrl.cli``, ``meshrl.integrations``, ``meshrl.report``.
"""

__version__ = "0.1.0"
