"""One rank of a tiny SFT (sft-frozen: with frozen lower layers) / DPO / reward-model run;
launched by tests/test_distributed.py with or without torchrun.

    python tests/dist_stage_worker.py STAGE TOKENIZER_DIR RUN_DIR STRATEGY SFT_DATA
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from posttrain.model.loading import load_tokenizer  # noqa: E402
from posttrain.stages.preference import dpo  # noqa: E402
from posttrain.stages.reward_model import reward_model  # noqa: E402
from posttrain.stages.sft import sft  # noqa: E402
from tests.conftest import make_tiny_model, make_tiny_reward_model, stage_config  # noqa: E402

if __name__ == "__main__":
    stage, tok_dir, run_dir, strategy, data = sys.argv[1:6]
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tok_dir)
    # 13 rows in batches of 4: the last batch has one row, so one of two ranks has none
    common = dict(run_dir=run_dir, strategy=strategy, batch_size=4, lr=1e-2, epochs=2)
    if stage in ("sft", "sft-frozen"):    # sft-frozen: embeddings and layer 0 of 2 frozen
        sft(stage_config(data=data, freeze_layers=int(stage == "sft-frozen"), **common),
            model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    elif stage == "dpo":
        dpo(stage_config(synthetic="addition", n_pairs=13, eval_size=6, beta=0.1, **common),
            model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    else:
        reward_model(stage_config(synthetic="addition", n_pairs=13, eval_size=6, **common),
                     model=make_tiny_reward_model(tokenizer), tokenizer=tokenizer, show_progress=False)
