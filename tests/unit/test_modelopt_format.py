"""ModelOpt's layouts decoded from bytes worked by hand: NVFP4's nibble order and scale product, FP8's one
scale; and a folder that says `modelopt` only in hf_quant_config.json is detected as ModelOpt's."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save_file

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.modelopt import decode_fp8, decode_nvfp4


def test_nvfp4_puts_the_even_column_in_the_low_nibble_and_scales_each_block_of_16():
    # Byte 0x2F: low nibble 0xF (-6) is column 0, high nibble 0x2 (1.0) column 1; the rest zero codes.
    packed = np.zeros((1, 16), dtype=np.uint8)
    packed[0, 0], packed[0, 8] = 0x2F, 0x71  # block 1 starts at column 16: byte 8 holds columns 16, 17
    block_scales = np.array([[0x38, 0x40]], dtype=np.uint8)  # FP8 E4M3: 1.0 and 2.0
    out = decode_nvfp4(packed, block_scales, 0.5)
    assert out.shape == (1, 32)
    assert out[0, :2].tolist() == [-6 * 0.5, 1 * 0.5]
    assert out[0, 16:18].tolist() == [0.5 * 2.0 * 0.5, 6 * 2.0 * 0.5]
    assert not out[0, 2:16].any() and not out[0, 18:].any()


def test_fp8_multiplies_every_code_by_the_tensors_one_scale():
    codes = np.array([[0x38, 0xB8, 0x7E]], dtype=np.uint8)  # 1.0, -1.0, 448
    assert decode_fp8(codes, 0.25).tolist() == [[0.25, -0.25, 112.0]]


def test_a_folder_naming_modelopt_only_in_hf_quant_config_is_modelopt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    beside = {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": {"quant_algo": "FP8"}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(beside))
    weight = torch.zeros((4, 4), dtype=torch.float8_e4m3fn)
    save_file({"w.weight": weight, "w.weight_scale": torch.tensor(1.0)}, str(tmp_path / "model.safetensors"))
    assert Checkpoint.open(tmp_path).format == "modelopt"
