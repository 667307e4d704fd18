"""The RLVR trainer (engine layer): its public API. Modules outside the trainer import from here, never from its
submodules (``tests/unit/test_layering.py``); the step itself is :mod:`meshrl.trainer.step`."""

from meshrl.trainer.batch import MicroBatch, collate, response_logits, token_entropy, token_logprobs
from meshrl.trainer.config import MESH_RECIPES, RunConfig, load_config
from meshrl.trainer.config_reference import config_reference
from meshrl.trainer.episodes import generate_scored, transcript
from meshrl.trainer.failure import HealthStop, NonFiniteAbort, RewardsFailed, StalledRun
from meshrl.trainer.history import StepHistory
from meshrl.trainer.loop import Trainer, train
from meshrl.trainer.mei_monitor import load_threshold
from meshrl.trainer.policy import load_policy, read_run_config
from meshrl.trainer.rollout_step import PromptBudget, context_limit, encode_within_limit
from meshrl.trainer.signals import RunInterrupted
from meshrl.trainer.sweep import command_lines, load_sweep, run_sweep, summarize_sweep

__all__ = ["MESH_RECIPES", "HealthStop", "MicroBatch", "NonFiniteAbort", "PromptBudget", "RewardsFailed", "RunConfig",
           "RunInterrupted", "StalledRun", "StepHistory", "Trainer", "collate", "command_lines", "config_reference",
           "context_limit", "encode_within_limit", "generate_scored", "load_config", "load_policy", "load_sweep",
           "load_threshold", "read_run_config", "response_logits", "run_sweep", "summarize_sweep", "token_entropy",
           "token_logprobs", "train", "transcript"]
