"""Coach Prompting, offline: ask a coach for m strategy prefixes per problem, validate, cache, wrap.

Layer 2: works on the queries it is handed (``[{"id", "problem", "answer"}, ...]``); it never loads
tasks or models itself. The CLI passes a local model as a :class:`CallableBackend`.
"""

from meshrl.mesh.budget import BUDGET_MODES, baseline_group_size, budget_groups
from meshrl.mesh.coach.backends import (
    BackendError,
    CallableBackend,
    ChatBackend,
    MissingKeyError,
    OpenAIChatBackend,
    RuleCoach,
    describe_backend,
    redact_url,
)
from meshrl.mesh.coach.generate import (
    CoachSummary,
    generate_prefixes,
    load_prefix_records,
    load_prefixes,
    normalize_problem,
    prefixes_by_problem,
    query_key,
)
from meshrl.mesh.coach.prompts import (
    COACH_PROMPT_VERSION,
    PLACEMENTS,
    TEMPLATE_VERSION,
    TEMPLATES,
    check_conditioning,
    coach_messages,
    condition_prompt,
    retry_messages,
    self_strategy_prompt,
    wrap_prefix,
)
from meshrl.mesh.coach.validate import (
    CoachParseError,
    PrefixRules,
    answer_number,
    check_answer,
    jaccard,
    leaks_answer,
    normalize_text,
    number_tokens,
    parse_strategies,
    validate_strategies,
)

__all__ = [
    "BUDGET_MODES",
    "COACH_PROMPT_VERSION",
    "PLACEMENTS",
    "TEMPLATE_VERSION",
    "TEMPLATES",
    "BackendError",
    "CallableBackend",
    "ChatBackend",
    "CoachParseError",
    "CoachSummary",
    "MissingKeyError",
    "OpenAIChatBackend",
    "PrefixRules",
    "RuleCoach",
    "answer_number",
    "baseline_group_size",
    "budget_groups",
    "check_answer",
    "check_conditioning",
    "coach_messages",
    "condition_prompt",
    "describe_backend",
    "generate_prefixes",
    "jaccard",
    "leaks_answer",
    "load_prefix_records",
    "load_prefixes",
    "prefixes_by_problem",
    "normalize_problem",
    "normalize_text",
    "number_tokens",
    "parse_strategies",
    "query_key",
    "redact_url",
    "retry_messages",
    "self_strategy_prompt",
    "validate_strategies",
    "wrap_prefix",
]
