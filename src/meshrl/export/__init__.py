"""Exporters (a face, layer 4, docs/architecture.md): a run or a task in a format another tool loads.

- :mod:`~meshrl.export.model`: ``meshrl export model``, a run's checkpoint as a Hugging Face model directory
  (:func:`export_model`, docs/export.md);
- :mod:`~meshrl.export.trl`: ``meshrl export trl``, the dataset a TRL GRPO run reads for Mesh Learning
  (:func:`export_trl`; the trainer and the reward function are :mod:`meshrl.integrations.trl`);
- :mod:`~meshrl.export.verl`: ``meshrl export verl``, verl's RL parquet and a reward module (:func:`export_verl`;
  the reward it names is :mod:`meshrl.integrations.verl.reward`);
- :mod:`~meshrl.export.args`: the options the exporters share; :mod:`~meshrl.export.command`: the ``meshrl
  export`` command (:data:`~meshrl.export.command.EXPORTERS`).

Like every face, it may import anything below it and nothing but the CLI imports it. None of it imports trl or verl.
"""

from meshrl.export.command import EXPORTERS, add_parser
from meshrl.export.model import export_model, select_checkpoint
from meshrl.export.trl import export_trl
from meshrl.export.verl import export_verl

__all__ = ["EXPORTERS", "add_parser", "export_model", "export_trl", "export_verl", "select_checkpoint"]
