"""The shared forward (forward.response_hidden): a prefix common to all prompts runs once, each
group's rest of the prompt once, then the responses; the result must be the plain forward's."""

import pytest
import torch

from posttrain.config.options import load_config
from posttrain.rollout.forward import response_logits
from posttrain.rollout import Rollout, SamplingParams, make_engine
from posttrain.data.source import build_task
from posttrain.model.prompts import after_shared_prefix, common_prefix_length, encode_prompts
from tests.conftest import make_tiny_model


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def test_common_prefix_length_by_hand():
    assert common_prefix_length(*left_padded([[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6, 11, 12]])) == 2
    assert common_prefix_length(*left_padded([[20, 6, 7], [5, 6, 7, 8]])) == 0
    # identical prompts: all but the last token, whose hidden state predicts the response
    assert common_prefix_length(*left_padded([[5, 6, 7], [5, 6, 7]])) == 2
    assert common_prefix_length(*left_padded([[5, 6, 7, 8], [5, 6]])) == 1
    assert common_prefix_length(*left_padded([[5], [5, 6]])) == 0


def test_after_shared_prefix_by_hand():
    """Prompts [5 6 7 8 9] and [5 6 10] share k=2: the prefix row is [5 6]; the rest starts at the
    longest prompt's column 2; the shorter prompt's columns there hold its prefix (masked) then 10."""
    ids, mask = left_padded([[5, 6, 7, 8, 9], [5, 6, 10]])
    prefix, cut, rest_mask = after_shared_prefix(ids, mask, 2)
    assert prefix.tolist() == [[5, 6]] and cut == 2
    assert ids[:, cut:].tolist() == [[7, 8, 9], [5, 6, 10]]
    assert rest_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 1]]


CASES = {
    "shared prefix, lengths differ": [[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6, 11, 12, 13, 14]],
    "no shared prefix": [[20, 6, 7], [5, 6, 7, 8], [9, 10]],
    "one-token prompts": [[5], [9]],
    "one group": [[5, 6, 7, 8]],
}


def assert_matches_plain_forward(model, rollout):
    """response_logits (shared passes) against one plain forward per row: same logits at the
    response positions and same parameter gradients of their sum."""
    prompt_ids, prompt_mask = rollout.prompt_ids_B_L, rollout.prompt_mask_B_L
    response_ids, response_mask = rollout.response_ids_B_T, rollout.response_mask_B_T
    model.zero_grad()
    shared = response_logits(model, rollout)
    (shared * response_mask[..., None]).sum().backward()
    g_shared = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    T = response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask.long()], 1)
    full = model(input_ids=ids, attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -(T + 1):-1]
    (full * response_mask[..., None]).sum().backward()
    m = response_mask.bool()
    torch.testing.assert_close(shared[m], full[m])
    for a, p in zip(g_shared, model.parameters()):
        # float64 model, but transformers computes rotary angles in float32: ~1e-7 relative noise
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("case", CASES)
def test_prefix_shared_forward_equals_plain_forward_values_and_gradients(tokenizer, case):
    G, T = 2, 4
    model = make_tiny_model(tokenizer, seed=3).double()
    prompt_ids, prompt_mask = left_padded(CASES[case])
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    b = len(prompt_ids)
    response_ids = torch.randint(100, 1000, (b, T), generator=torch.Generator().manual_seed(0))
    response_mask = torch.ones(b, T)
    response_mask[1, 2:] = 0                       # a response that stopped early (right-padded)
    rollout = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, torch.zeros(b, T),
                      torch.zeros(b, dtype=torch.bool), G)
    assert_matches_plain_forward(model, rollout)


def test_sampled_chat_prompts_and_gradient_checkpointing_match_the_plain_forward(tokenizer):
    """Real chat-templated prompts and sampled responses (the trainer's layout); and with gradient
    checkpointing on, the full-sequence path gives the same logits and gradients."""
    model = make_tiny_model(tokenizer, seed=7).double()
    task = build_task(load_config(None, ["--data.eval_size", "3"]).data)
    engine = make_engine("hf", model, tokenizer)
    r = engine.generate(encode_prompts(tokenizer, task.eval_problems, "Be brief."), 3,
                        SamplingParams(5), torch.Generator().manual_seed(0))
    assert r.group_size == 3
    assert common_prefix_length(r.prompt_ids_B_L[::3], r.prompt_mask_B_L[::3]) > 10
    assert_matches_plain_forward(model, r)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert_matches_plain_forward(model, r)
