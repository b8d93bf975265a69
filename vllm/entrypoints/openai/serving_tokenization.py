"""POST /tokenize and /detokenize: vLLM's bodies.

/tokenize takes `{model?, prompt, add_special_tokens=true, return_token_strs=false}` or `{model?, messages,
tools?, add_generation_prompt=true, continue_final_message=false, add_special_tokens=false, chat_template?,
chat_template_kwargs?, return_token_strs=false}` (the prompt the chat endpoint builds from the same fields, with
the same checks and the server's --chat-template), and answers `{count, max_model_len, tokens, token_strs}`
(`token_strs`: the tokens' vocabulary strings, null unless asked). /detokenize takes `{model?, tokens}` and
answers `{prompt}`, the ids decoded with special tokens kept; an id outside the vocabulary is a 400.
"""

from __future__ import annotations

from vllm.entrypoints.openai.protocol_tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                       TokenizeCompletionRequest, TokenizeResponse)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.exceptions import VLLMValidationError


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.served_model_names, chat.preprocess)
        self.chat = chat

    def _require_tokenizer(self, parameter: str) -> None:
        if self.tokenizer is None:
            raise VLLMValidationError("Tokenizing needs a tokenizer, but the server runs with --skip-tokenizer-init.",
                                      parameter=parameter)

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            self._require_tokenizer("messages")
            token_ids = await self.chat._prompt_token_ids(request)
        else:
            self._require_tokenizer("prompt")
            token_ids = await self.encode(request.prompt, request.add_special_tokens, "prompt")
        assert self.tokenizer is not None
        token_strs = None
        if request.return_token_strs:
            token_strs = [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(token_ids)]
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(request.model)
        self._require_tokenizer("tokens")
        assert self.tokenizer is not None
        vocab_size = self.tokenizer.vocab_size
        for i, token_id in enumerate(request.tokens):
            if not 0 <= token_id < vocab_size:
                raise VLLMValidationError(f"tokens[{i}] = {token_id} is not a token id of this tokenizer (0 to "
                                          f"{vocab_size - 1}).", parameter="tokens", value=token_id)
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
