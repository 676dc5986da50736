"""Shared fixtures: tiny random transformers models (float64) and the `--impl` switch for grading."""
from __future__ import annotations

import os

import pytest
import torch

# Two pytest-xdist workers on two cores: one torch thread each. With the default (a thread per core
# in every worker) the workers' OpenMP threads fight over the cores and runs get 10-50x slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("solutions", "exercises"), default="solutions",
                     help="which implementation the grading tests load: the reference solutions/ "
                          "(the project's own run) or a student's exercises/")


@pytest.fixture(scope="session")
def impl_name(request) -> str:
    return request.config.getoption("--impl")


def make_tiny_model(tmp_path_factory, kind: str, tie: bool = False, seed: int = 0):
    """Save a tiny random transformers model in float64; return (folder, the transformers model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    extra = {"head_dim": 32} if kind == "qwen3" else {}
    config = cls(**TINY, tie_word_embeddings=tie, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    if kind == "qwen2":  # transformers initialises biases to zero; make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
    folder = tmp_path_factory.mktemp(f"tiny-{kind}-{'tied' if tie else 'untied'}")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session", params=[("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False),
                                         ("qwen3", True)], ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def tiny_model(request, tmp_path_factory):
    kind, tie = request.param
    return make_tiny_model(tmp_path_factory, kind, tie)


@pytest.fixture(scope="session")
def default_model_dir():
    from minivllm.model_files import resolve_model

    return resolve_model(None)
