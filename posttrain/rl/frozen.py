"""Step 2 of the lecture's loop: the log-probs no gradient flows through (docs/algorithms.md §3,
§6, §8): the trainer's own pi_old when another engine sampled, pi_ref for a KL term, and the
teacher's log-probs of the student's own tokens (OPSD: after a prompt with privileged
information). Only the passes a term of the step reads run (loss_terms.frozen_inputs)."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace

from posttrain.config.commands import TrainConfig
from posttrain.losses.common import masked_mean
from posttrain.losses.distill import sampled_reverse_kl
from posttrain.model.prompts import encode_prompts, left_pad
from posttrain.rollout import Rollout
from posttrain.rollout.forward import frozen_logprobs, micro_rows
from posttrain.sampling.batch import ScoredBatch
from posttrain.rl.learner import PolicyLearner
from posttrain.rl.loss_terms import frozen_inputs
from posttrain.sampling.metrics import read_floats
from posttrain.rl.step_metrics import per_domain


def teacher_view(batch: ScoredBatch, cfg: TrainConfig, tokenizer) -> Rollout:
    """The batch's responses after the teacher's prompts (OPSD: with privileged information).

    Prompts are left-padded and responses right-padded, so however long the teacher's prompt is,
    response token t sits at the same column after it: the teacher's log-probs line up token for
    token with the student's.
    """
    template = cfg.teacher.context_template
    if template is None:
        return batch.rollout
    G = batch.rollout.group_size
    shown = [replace(p, prompt=template.format(prompt=p.prompt, answer=p.answer), messages=None)
             for p in batch.problems[::G]]
    ids, mask = left_pad(encode_prompts(tokenizer, shown, cfg.data.system_prompt,
                                        cfg.data.chat_template), tokenizer.pad_token_id)
    device = batch.rollout.prompt_ids_B_L.device
    return replace(batch.rollout, prompt_ids_B_L=ids.repeat_interleave(G, 0).to(device),
                   prompt_mask_B_L=mask.repeat_interleave(G, 0).to(device))


def frozen_passes(learner: PolicyLearner, batch: ScoredBatch,
                  timings: Counter) -> tuple[ScoredBatch, dict[str, float]]:
    """The log-probs no gradient flows through (§3, §6, §8): the trainer's own pi_old when
    another engine sampled (its log-probs differ slightly; the update reweights by their ratio),
    pi_ref for the KL penalty, and the teacher's log-probs of the student's own tokens. Returns
    the batch with them and the stage's metrics (the teacher's sampled reverse KL)."""
    metrics: dict[str, float] = {}
    cfg, algo, model = learner.cfg, learner.algo, learner.model
    temperature, autocast = cfg.rollout.temperature, cfg.model.autocast
    micro = micro_rows(cfg.optim, batch.rollout)
    t0 = time.perf_counter()
    needs = frozen_inputs(cfg, algo, learner.teachers is not None)   # what the step's terms read
    # the sampler's log-probs are not the trainer's when another engine sampled, or when the
    # trainer's forward runs in another precision than the sampler's (model.autocast bfloat16
    # against a float32 sampler: bf16 noise, far above GSPO's 4e-4 clip): pi_old is recomputed
    # by the trainer itself, so the first minibatch's ratio is 1 up to its own numerics
    if "trainer_old_logp" in needs:
        batch = replace(batch, trainer_old_logp_B_T=frozen_logprobs(model, batch.rollout,
                                                                    temperature, micro, autocast))
        timings["old_logprobs"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if "ref_logp" in needs:
        with model.disable_adapter() if learner.lora else nullcontext():
            batch = replace(batch, ref_logp_B_T=frozen_logprobs(learner.ref_model or model,
                                                                batch.rollout, temperature,
                                                                micro, autocast))
    timings["reference"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    if learner.teachers is not None:
        batch = replace(batch, teacher_view=teacher_view(batch, cfg, learner.tokenizer))
    # (a per-position loss, distill_loss exact / forward: the update runs the teacher itself,
    # micro-batch by micro-batch; a separate pass here would be wasted)
    if "teacher_logp" in needs:
        tau = cfg.teacher.temperature or temperature
        teacher_logp = learner.teachers.logprobs(
            batch.teacher_view, [p.domain for p in batch.problems],
            lambda m, view: frozen_logprobs(m, view, tau, micro, autocast))
        batch = replace(batch, teacher_logp_B_T=teacher_logp)
        kl = sampled_reverse_kl(batch.old_logp_B_T, batch.teacher_logp_B_T)
        metrics.update(read_floats({"distill/reverse_kl": masked_mean(kl, batch.loss_mask_B_T),
                                    **per_domain(batch, kl)}))
    elif learner.teachers is not None:
        metrics.update(read_floats(per_domain(batch)))
    timings["teacher"] += time.perf_counter() - t0
    return batch, metrics
