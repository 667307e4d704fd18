"""meshrl: RL with verifiable rewards for language models that does not collapse.

Layers (imports point down only):
1. ``meshrl.algos`` / ``meshrl.stats``: pure tensor functions and registries.
2. ``meshrl.mesh`` / ``meshrl.diagnostics``: coach prompting, strategy balancing, MEI, coupling kernel.
3. engine: ``meshrl.models``, ``meshrl.rollout``, ``meshrl.rewards``, ``meshrl.tasks``, ``meshrl.trainer``.
4. faces: ``meshrl.cli``, ``meshrl.integrations``, ``meshrl.report``.
"""

from meshrl.kernel_caches import bound_kernel_caches

__version__ = "0.1.0"

bound_kernel_caches()  # before any oneDNN kernel is built: they read their capacity once (see meshrl.kernel_caches)
