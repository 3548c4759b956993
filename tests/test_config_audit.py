"""Config values read as transformers reads them, and sizes as they are written."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from expertcache.config import RopeConfig, parse_size


@pytest.mark.parametrize("text,want", [("2.01G", 2_010_000_000), ("1.5GiB", 3 * 2**29), ("0.3MB", 300_000),
                                       ("4.1KB", 4100), ("300", 300)])
def test_a_decimal_size_is_the_bytes_written(text, want):
    # float('2.01') * 10**9 is 2009999999.9999998: cut to an int, one byte short.
    assert parse_size(text) == want


def test_yarn_takes_a_top_level_original_context_over_the_rope_sections(tmp_path):
    # transformers moves a top-level original_max_position_embeddings into the YaRN parameters
    # (Phi-3 style configs keep the pretraining length there), over the section's own value.
    raw = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
           "max_position_embeddings": 4096, "original_max_position_embeddings": 256,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                               "rope_theta": 10000.0}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(tmp_path), "cpu")
    ours = RopeConfig.from_hf(raw, raw["max_position_embeddings"])
    got, scale = ours.inv_freq(16)
    assert ours.original_max_position == 256
    assert torch.equal(got, want) and scale == pytest.approx(want_scale)
