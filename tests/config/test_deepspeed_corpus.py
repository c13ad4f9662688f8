"""Real DeepSpeed configs from public projects (tests/data/deepspeed_configs, sources in its README), each
read as it would be for 2 nodes of 8 ranks: it trains (a Config, hpZ's groups fit), or it is refused in
one line naming the key as the file writes it, for a feature zeropp does not have."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeropp.config.deepspeed import translate
from zeropp.errors import ConfigError
from zeropp.index.ranks import Layout

CORPUS = Path(__file__).resolve().parents[1] / "data" / "deepspeed_configs"
LAYOUT = Layout(16, 2)
HIDDEN = 64  # resolves the "auto" bucket sizes

# file -> what its one-line refusal says (every other file trains)
REFUSED = {
    "deepspeed__ds_config_zero3_sdma.json":  # not a DeepSpeed 0.19 key (nor a key 0.19's own reader accepts)
        "DeepSpeed key 'zero_optimization.sdma_allgather' is not known to zeropp",
    "deepspeedexamples__bing_bert_lamb_config_seq128.json": "DeepSpeed's sparse attention kernels are not part of zeropp",
    "deepspeedexamples__cifar_ds_config.json":
        "DeepSpeed fp16.fp16_master_weights_and_grads = true is not allowed: zeropp keeps fp32 master weights",
    "deepspeedexamples__ds_zero_stage_infinity_config.json":  # a typo DeepSpeed 0.19 refuses too
        "DeepSpeed key 'zero_optimization.stage3_param_persitance_threshold' is not known to zeropp",
    "deepspeedexamples__zenflow_zf_config.json": "is not allowed: ZenFlow is not implemented",
    "llama-factory__ds_z3_fp8_config.json": "is not allowed: zeropp trains in fp32, bf16 or fp16",
    "transformers__ds_config_zero3.json":  # DeepSpeed 0.19 requires reduce_bucket_size > 0 too
        "DeepSpeed zero_optimization.reduce_bucket_size = 0 is not allowed; expected an integer >= 1",
}  # fmt: skip
FILES = sorted(path.name for path in CORPUS.glob("*.json"))


def read(name: str) -> None:
    translation = translate(CORPUS / name, world_size=LAYOUT.world_size, hidden_size=HIDDEN)
    with translation.worded():
        config = translation.config()
        LAYOUT.hpz_group_size(config.zero.hpz_partition_size)
    note = translation.note()
    assert note is None or "\n" not in note


def test_the_corpus_is_real_configs_from_many_projects_each_with_its_source():
    readme = (CORPUS / "README.md").read_text()
    assert len(FILES) >= 30 and len({name.split("__")[0].removesuffix("-next") for name in FILES}) >= 8
    assert all(f"`{name}`" in readme for name in FILES) and set(REFUSED) <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_each_config_trains_or_is_refused_in_one_line_saying_why(name):
    if name not in REFUSED:
        read(name)
        return
    with pytest.raises(ConfigError) as error:
        read(name)
    assert REFUSED[name] in str(error.value) and "\n" not in str(error.value)
