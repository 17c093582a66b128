"""Checkpoints the engine tests share."""
import pytest


@pytest.fixture(scope="session")
def tiny_qwen2_4l_dir(tmp_path_factory, tokenizer_dir):
    """A 4-layer Qwen2 (q/k/v bias, GQA, untied head) with large random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import save_tiny_checkpoint
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
                         rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(4321)
    return save_tiny_checkpoint(Qwen2ForCausalLM(config), tmp_path_factory.mktemp("tiny-qwen2-4l"), tokenizer_dir)
