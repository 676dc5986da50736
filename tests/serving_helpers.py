"""Chapter 12's test models: a tiny float64 Llama that carries SmolLM2's tokenizer and chat template, so
the server's text, chat and token counting are real while a step costs milliseconds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def make_tiny_chat_model(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random float64 Llama (`course.testing.make_tiny_model`) with SmolLM2-135M-Instruct's
    vocabulary size, tokenizer, chat template and end-of-sequence ids, saved in `folder`."""
    from minivllm.course.testing import make_tiny_model
    from minivllm.transformers_utils.model_files import resolve_model

    folder, source = Path(folder), resolve_model(None)
    config = json.loads((source / "config.json").read_text())
    make_tiny_model(folder, "llama", tie=False, seed=seed, vocab_size=config["vocab_size"],
                    bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder
