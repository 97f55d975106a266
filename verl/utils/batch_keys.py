"""The one place where DataProto key names are defined.

Shapes: B = batch rows, P = prompt length (left-padded), R = response length
(right-padded), T = P + R. Every worker method's docstring names the keys it
reads and writes from this table; code uses these constants (or the identical
literal) so a typo is caught by `check_known_keys`.
"""

from __future__ import annotations

# --- tensors, batch[...] ---------------------------------------------------
INPUT_IDS = "input_ids"              # (B, T) long: prompt + response
ATTENTION_MASK = "attention_mask"    # (B, T) long: 1 = real token, 0 = pad
POSITION_IDS = "position_ids"        # (B, T) long: cumsum(attention_mask) - 1, clipped at 0
PROMPTS = "prompts"                  # (B, P) long, left-padded
RESPONSES = "responses"              # (B, R) long, right-padded (all turns, observations included)
INFO_MASK = "info_mask"              # (B, T) long: attention_mask with observation tokens set to 0
LOSS_MASK = "loss_mask"              # (B, R) long: 1 = token the policy sampled (not pad, not observation)
CONTEXT_CUT_MASK = "context_cut_mask"  # (B, R) long: 1 = policy token sampled from a rolling context
                                       #   that had dropped older turns (kept out of the update)
RESPONSE_MASK = "response_mask"      # (B, R) long: THE mask every loss / KL / whitening / GAE uses.
                                     #   = loss_mask when actor.state_masking, else attention_mask[:, P:]
OLD_LOG_PROBS = "old_log_probs"      # (B, R) float: log-probs of the rollout policy
SUM_PI_SQUARED = "sum_pi_squared"    # (B, R) float: sum_v pi_old(v)^2 per token (actor.calculate_sum_pi_squared)
ROLLOUT_LOG_PROBS = "rollout_log_probs"   # (B, R) float: the engine's own log-prob of each sampled token
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"  # (B, R) float: truncated pi_old / pi_rollout (algorithm.rollout_correction)
TOKEN_VERSIONS = "token_versions"         # (B, R) long: policy version that sampled each position (partial rollout; -1 pad)
REF_LOG_PROB = "ref_log_prob"        # (B, R) float: log-probs of the reference policy
VALUES = "values"                    # (B, R) float: critic values
REWARD_BASELINES = "reward_baselines"        # (B,) float: ReMax's baseline, the greedy rollout's score of the row's prompt
TOKEN_LEVEL_SCORES = "token_level_scores"    # (B, R) float: rule reward, on the last policy token
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # (B, R) float: scores minus in-reward KL penalty
ADVANTAGES = "advantages"            # (B, R) float
RETURNS = "returns"                  # (B, R) float

# --- non-tensors, non_tensor_batch[...] (numpy object arrays of length B) -----
UID = "uid"                          # per-prompt unique id; GRPO / RLOO group key
DATA_SOURCE = "data_source"          # e.g. "nq"; selects the scorer
REWARD_MODEL = "reward_model"        # {"style": "rule", "ground_truth": {"target": [...]}}
EXTRA_INFO = "extra_info"            # {"split": ..., "index": ...}
INDEX = "index"                      # row index in the source data set
# What tools, agent loops and interactions leave on a row (veRL's names; a custom reward function reads the
# rewards in its extra_info: tool_rewards, turn_scores, rollout_reward_scores, num_turns; docs/agent.md)
AGENT_NAME = "agent_name"            # str: the agent loop that rolls the row out (veRL's data column)
RAW_PROMPT = "raw_prompt"            # list[dict]: the row's chat messages (data.return_raw_chat; agent loops)
TOOL_REWARDS = "tool_rewards"        # list[float]: the step rewards of its tools' execute, in call order
REWARD_SCORES = "reward_scores"      # dict: tool name -> its calc_reward when the trajectory ended
TURN_SCORES = "turn_scores"          # list[float]: an interaction's score for each user turn
NUM_TURNS = "__num_turns__"          # int: assistant turns + environment turns + 1 (veRL's count)
AGENT_EXTRA_FIELDS = "agent_extra_fields"      # dict: an agent loop's AgentLoopOutput.extra_fields
ROLLOUT_REWARD_SCORE = "rollout_reward_score"  # float | None: an agent loop's own reward_score (replaces the
                                               #   reward function's score for that row, as veRL's rm_scores)
AGENT_KEYS = frozenset({AGENT_NAME, RAW_PROMPT, TOOL_REWARDS, REWARD_SCORES, TURN_SCORES, NUM_TURNS,
                        AGENT_EXTRA_FIELDS, ROLLOUT_REWARD_SCORE})
AGENT_TRACE = "agent_trace"          # search_r1.llm_agent.trajectory.RowTrace: each turn's token counts, action,
                                     #   queries, retrieved ids, and the stop reason (multi-turn rollouts only)
REWARD_EXTRA_INFO = "reward_extra_info"  # dict per row: the reward's parts (score, em, f1, judge, format_valid,
                                         #   overlong penalty, a custom function's extra values)

# --- meta_info[...] -----------------------------------------------------------
META_EOS_TOKEN_ID = "eos_token_id"
META_PAD_TOKEN_ID = "pad_token_id"
META_DO_SAMPLE = "do_sample"         # False = greedy (validation)
META_TEMPERATURE = "temperature"
META_TOP_P = "top_p"                 # override rollout.top_p / top_k for this call (sampled validation)
META_TOP_K = "top_k"
META_VALIDATE = "validate"           # True: the trainer's validation rollout (its sampling: rollout.val_kwargs)
META_RESPONSE_LENGTH = "response_length"  # max new tokens for this generation call
META_STOP = "stop"                   # list[str] stop strings for this generation call
META_MICRO_BATCH_SIZE = "micro_batch_size"
META_USE_DYNAMIC_BSZ = "use_dynamic_bsz"
META_MAX_TOKEN_LEN = "max_token_len"
META_GLOBAL_TOKEN_NUM = "global_token_num"
# bool: the engine's rollout_log_probs are under the distribution the actor recomputes (full softmax at
# the rollout temperature); False where vLLM can only give nucleus/top-k renormalised ones.
META_ROLLOUT_LOG_PROBS_MATCH_ACTOR = "rollout_log_probs_match_actor"
META_METRICS = "metrics"             # dict[str, float | list[float]] returned by update_* methods

TENSOR_KEYS = frozenset({
    INPUT_IDS, ATTENTION_MASK, POSITION_IDS, PROMPTS, RESPONSES, INFO_MASK, LOSS_MASK, CONTEXT_CUT_MASK,
    RESPONSE_MASK, OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, ROLLOUT_IS_WEIGHTS, TOKEN_VERSIONS, REF_LOG_PROB, VALUES,
    TOKEN_LEVEL_SCORES, REWARD_BASELINES, SUM_PI_SQUARED,
    TOKEN_LEVEL_REWARDS, ADVANTAGES, RETURNS,
})
NON_TENSOR_KEYS = frozenset({UID, DATA_SOURCE, REWARD_MODEL, EXTRA_INFO, INDEX, AGENT_TRACE, REWARD_EXTRA_INFO})

NON_TENSOR_KEYS = NON_TENSOR_KEYS | AGENT_KEYS


def check_known_keys(keys: list[str] | set[str], where: str) -> None:
    """Raise KeyError naming `where` if a key is not in this table."""
    unknown = sorted(set(keys) - TENSOR_KEYS - NON_TENSOR_KEYS)
    if unknown:
        raise KeyError(f"{where}: unknown batch key(s) {unknown}; known keys live in verl/utils/batch_keys.py")
