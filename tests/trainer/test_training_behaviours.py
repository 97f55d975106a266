"""Training behaviours that decide what the model learns:

- the outcome score sits on the last POLICY token, also when the row ends in an observation, so
  GAE and REINFORCE++ (which skip masked positions) see it;
- a positive `actor.entropy_coeff` raises entropy (the sign of the entropy term, by a one-step
  gradient check against a loss computed by hand);
- `actor.state_masking=false` trains on observation tokens: through the trainer with search, the
  response mask the update uses equals the response's attention mask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from tests.trainer import test_search_e2e
from tests.trainer.test_reward import _batch, _row
from tests.trainer.test_search_e2e import SearchWorld, _search_overrides
from tests.workers._batches import make_ppo_batch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.reward import RewardManager
from verl.utils import batch_keys as K
from verl.utils.tiny_model import train_bpe_tokenizer
from verl.workers.actor.dp_actor import DataParallelPPOActor

search_world = test_search_e2e.search_world   # the module-scoped fixture: server, warmed-up model, data

BUDGET_NOTICE = "\nMy search budget is spent: this search was not run, and I cannot search any more.\n"


# --- 1: the score on the last policy token, whatever follows it -----------------------------

@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer()


def _rows_ending_in_observations(tok) -> list[tuple[list[int], list[int]]]:
    """An answered row that ends in an observation (a budget notice after it), and one that
    ends in the <information> block of its last search; neither ends with a policy token."""
    info = ("\n\n<information>Doc 1(Title: Beijing) Beijing is the capital of China.</information>\n\n", False)
    answered = [("<think>search first</think><search> capital of China </search>", True), info,
                ("<think>found it</think><answer> Beijing </answer>", True), (BUDGET_NOTICE, False)]
    searched_last = [("<think>search</think><search> capital of China </search>", True), info]
    return [_row(tok, answered, eos=False), _row(tok, searched_last, eos=False)]


def test_score_sits_on_last_policy_token_when_the_row_ends_in_an_observation(tok):
    rows = _rows_ending_in_observations(tok)
    data = _batch(tok, rows, ["nq", "nq"], [["Beijing"], ["Beijing"]])
    # Row 0 answered right (score 1); row 1 never answered (score 0, so no position at all).
    scores = RewardManager(tok, num_examine=0)(data)
    mask = data.batch[K.LOSS_MASK]
    for r, (_ids, row_mask) in enumerate(rows):
        assert row_mask[-1] == 0, "the row must end in an observation"
        last_policy = max(i for i, m in enumerate(row_mask) if m == 1)
        assert torch.nonzero(scores[r]).flatten().tolist() == ([last_policy] if r == 0 else [])
    assert scores[0].sum().item() == 1.0

    # GAE (gamma = lambda = 1, zero values) and REINFORCE++ see the score on every policy token
    # before it; a score on a masked position would be dropped (returns all 0).
    _, gae_returns = core_algos.compute_gae_advantage_return(scores, torch.zeros_like(scores), mask, 1.0, 1.0)
    _, rpp_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(scores, mask, gamma=1.0)
    policy = mask[0].bool()
    for returns in (gae_returns, rpp_returns):
        assert torch.allclose(returns[0][policy], torch.ones(int(policy.sum())))
        assert returns[0][~policy].abs().sum() == 0
        assert returns[1].abs().sum() == 0


def test_gae_and_reinforce_pp_returns_discount_from_the_last_policy_token(tok):
    """With gamma < 1 the return of a policy token is gamma^(policy tokens after it): the
    observation tokens between are not steps (the score's position decides every return)."""
    rows = _rows_ending_in_observations(tok)[:1]
    data = _batch(tok, rows, ["nq"], [["Beijing"]])
    scores = RewardManager(tok, num_examine=0)(data)
    mask = data.batch[K.LOSS_MASK]
    policy_positions = torch.nonzero(mask[0]).flatten().tolist()
    gamma = 0.9
    expected = torch.tensor([gamma ** (len(policy_positions) - 1 - k) for k in range(len(policy_positions))])
    _, gae_returns = core_algos.compute_gae_advantage_return(scores, torch.zeros_like(scores), mask, gamma, 1.0)
    _, rpp_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(scores, mask, gamma=gamma)
    for returns in (gae_returns, rpp_returns):
        torch.testing.assert_close(returns[0, policy_positions], expected)


# --- 6: the entropy term's sign ---------------------------------------------------------------

class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it steps on."""

    def __init__(self, module: torch.nn.Module, lr: float) -> None:
        self.named = list(module.named_parameters())
        super().__init__([p for _, p in self.named], lr=lr)
        self.grads: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.grads = {n: p.grad.detach().clone() for n, p in self.named}
        return super().step(closure)


def _token_mean_entropy(model: torch.nn.Module, data: Any) -> torch.Tensor:
    """Token-mean entropy of the policy over `response_mask`, from the full logits (by hand)."""
    b = data.batch
    length = b[K.RESPONSES].shape[1]
    logits = model(input_ids=b[K.INPUT_IDS], attention_mask=b[K.ATTENTION_MASK], position_ids=b[K.POSITION_IDS],
                   use_cache=False).logits[:, -length - 1:-1].float()
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    mask = b[K.RESPONSE_MASK].float()
    return (entropy * mask).sum() / mask.sum()


def test_positive_entropy_coeff_raises_entropy(tiny_model_dir):
    torch.manual_seed(0)
    coeff, lr = 0.5, 0.5
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    data = make_ppo_batch(model.config.vocab_size, batch_size=4, seed=2)
    data.batch[K.ADVANTAGES] = torch.zeros_like(data.batch[K.ADVANTAGES])   # no policy-gradient term
    data.meta_info[K.META_TEMPERATURE] = 1.0
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference.eval()   # update_policy runs in train mode; the tiny model has no dropout

    cfg = OmegaConf.create({"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2, "use_dynamic_bsz": False,
                            "grad_clip": None, "clip_ratio": 0.2, "entropy_coeff": coeff, "use_kl_loss": False,
                            "loss_agg_mode": "token-mean", "ppo_epochs": 1, "shuffle": False})
    optimizer = _RecordingSGD(model, lr=lr)
    DataParallelPPOActor(cfg, model, optimizer).update_policy(data)

    # By hand: loss = -coeff * entropy, so the step goes up the entropy gradient.
    entropy_before = _token_mean_entropy(reference, data)
    (-coeff * entropy_before).backward()
    for name, param in reference.named_parameters():
        expected = param.grad
        torch.testing.assert_close(optimizer.grads[name], expected, rtol=0,
                                   atol=1e-7 + 1e-4 * float(expected.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        entropy_after = _token_mean_entropy(model.eval(), data)
    assert entropy_after > entropy_before.detach() + 1e-4, (float(entropy_before), float(entropy_after))


# --- 5: state_masking=false trains on observations, through the trainer with search ------------

@pytest.mark.slow
def test_state_masking_off_trains_on_observation_tokens(ray_cluster, search_world: SearchWorld,
                                                        tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from verl.trainer.main_ppo import compose_config, run_ppo

    seen: list[dict[str, torch.Tensor]] = []
    rule = RewardManager(AutoTokenizer.from_pretrained(search_world.model_dir), num_examine=0)

    def recording_reward(batch: Any) -> torch.Tensor:
        R = batch.batch[K.RESPONSES].shape[1]
        seen.append({"response_mask": batch.batch[K.RESPONSE_MASK].clone(),
                     "response_attention": batch.batch[K.ATTENTION_MASK][:, -R:].clone(),
                     "loss_mask": batch.batch[K.LOSS_MASK].clone()})
        return rule(batch)

    overrides = _search_overrides(search_world, tmp_path, "grpo", ["actor_rollout_ref.actor.state_masking=false"])
    history = run_ppo(compose_config(overrides), reward_fn=recording_reward)
    assert [h["step"] for h in history] == [1]
    step = history[-1]
    assert seen, "the reward function never saw a training batch"
    batch = seen[-1]
    assert torch.equal(batch["response_mask"], batch["response_attention"].long())
    # The rollout searched: observation tokens exist, and they are in the mask the update uses.
    observations = (batch["response_attention"].long() - batch["loss_mask"].long()).clamp(min=0)
    assert observations.sum() > 0
    assert (batch["response_mask"][observations.bool()] == 1).all()
    assert step["env/number_of_valid_search"] > 0
