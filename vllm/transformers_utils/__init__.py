"""Loading Hugging Face-format tokenizer folders without transformers."""

from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer

__all__ = ["Tokenizer", "get_tokenizer"]
