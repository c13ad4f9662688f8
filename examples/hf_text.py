"""The "Hugging Face models" script of docs/hugging-face.md, runnable (tests/app/test_hf_cli.py runs it):
torchrun --nproc-per-node 2 examples/hf_text.py CONFIG_JSON TEXT OUT_DIR"""

import sys

import torch

import zeropp
from zeropp.app import hf
from zeropp.app.data.batches import Batches
from zeropp.app.data.text import ByteTokenizer, text_splits


def train(topology: zeropp.Topology, config_json: str, text: str, out: str, steps: int = 8) -> float:
    config = hf.causal_lm_config(hf_config=config_json)  # a local file: no downloads
    with torch.device("meta"):  # the engine initializes it unit by unit: no rank holds it whole
        model = hf.build_model(config)  # AutoModelForCausalLM.from_config, fp32
    engine = zeropp.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), zeropp.ZeroConfig(stage=3), topology)
    tokens, _ = text_splits(text, ByteTokenizer(), block_size=32)  # UTF-8 bytes; the last 5% is validation
    batches = Batches("train", 32, 2, topology.world_size, topology.rank, seed=0, tokens=tokens)
    for step in range(steps):
        x, y = batches.local_batch(step)  # this rank's 2 rows of the step's global batch
        loss = hf.causal_lm_loss(engine, x, y)  # cross-entropy of model(input_ids=x).logits against y
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()  # collective: every rank takes part
    if topology.rank == 0:
        hf.save_pretrained(state, config, out)  # AutoModelForCausalLM.from_pretrained(out) loads it
    return loss.item()


if __name__ == "__main__":
    with zeropp.init_topology() as topology:  # torchrun's environment; the groups are destroyed at the end
        loss = train(topology, *sys.argv[1:4])
        if topology.rank == 0:
            print(f"last loss {loss:.4f}; wrote {sys.argv[3]}")
